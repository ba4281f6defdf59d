"""The Docker image, built from the real Dockerfile and run, without Docker or NVIDIA's base.

buildah builds the Dockerfile (no daemon; --isolation chroot) on the stand-in
base of docker/stand-in-base.sh (Debian, CPU torch, Open MPI): only BASE_IMAGE changes.
Inside the image, as a non-root user the way ``docker run --user UID:GID`` starts it
(through the image's entrypoint), run: the Dockerfile's smoke test, the tiny PPO for 2
steps on 2 processes writing its run directory to a mounted host folder, and a
launch/convert.py round trip of its export. Then a one-file source change is rebuilt
(the dependency layers must come from the cache) and the image is exported as the OCI
archive that `apptainer build` and enroot (through podman) take.

A broken RUN step or COPY fails the build; a broken entrypoint or installed package
fails the runs. Marker ``container``: .ci/run runs these on their own (pytest -m
container). Needs root, buildah and debootstrap (.ci/run installs them), Debian's
archive and PyPI; skipped, with the reason, without root or the two tools. Not covered:
CUDA, NCCL, Transformer Engine and apex (NVIDIA's image has them, the stand-in does not).
The stand-in base and buildah's layer cache stay in MEGARL_BUILDAH_ROOT for the next run.

Storage: overlay where the kernel lets this process mount overlayfs, else vfs, which
copies the whole root file system for every layer (13 here): about 3x slower and 27 GB
of disk for one build; MEGARL_BUILDAH_DRIVER chooses.
"""
import functools
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time

import pytest

pytestmark = pytest.mark.container

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overlay_mounts() -> bool:
    """Whether this process can mount overlayfs (root in a container often cannot)."""
    with tempfile.TemporaryDirectory() as tmp:
        for sub in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(tmp, sub))
        opts = f"lowerdir={tmp}/lower,upperdir={tmp}/upper,workdir={tmp}/work"
        done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, f"{tmp}/merged"], capture_output=True)
        if done.returncode == 0:
            subprocess.run(["umount", f"{tmp}/merged"], check=True)
        return done.returncode == 0


@functools.cache
def storage() -> tuple[str, str]:
    """(buildah's storage driver, its storage folder), chosen on first use, not at collection."""
    driver = os.environ.get("MEGARL_BUILDAH_DRIVER") or ("overlay" if overlay_mounts() else "vfs")
    return driver, os.path.join(os.environ.get("MEGARL_BUILDAH_ROOT", "/var/tmp/megarl-buildah"), driver)
IMAGE = "localhost/megarl:container-test"
USER = "4321:4321"  # a host user's uid:gid, as `docker run --user $(id -u):$(id -g)` passes it
SMALL = ["data.batch_size=8", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "critic.micro_batch_size=4", "trainer.eval_samples=8", "trainer.tensorboard=false"]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (buildah's chroot isolation and debootstrap)"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install buildah debootstrap; .ci/run installs both as root)"
    return None


def buildah(*args, timeout=600, check=True) -> subprocess.CompletedProcess:
    driver, root = storage()
    cmd = ["buildah", "--storage-driver", driver, "--root", root, "--runroot", f"{root}/run", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{' '.join(cmd[:8])} ...: exit {done.returncode}\n" + \
            done.stdout[-4000:] + done.stderr[-4000:]
    return done


def network_mounts(tmp) -> list[str]:
    """Lends the build the host's CA certificates (a TLS-inspecting proxy signs PyPI's)."""
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if not os.path.isfile(ca):
        return []
    conf = tmp / "pip.conf"
    conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    return ["-v", f"{ca}:/etc/ssl/certs/ca-certificates.crt:ro", "-v", f"{conf}:/etc/pip.conf:ro"]


def build(context, base, tmp, tag=IMAGE) -> str:
    """buildah bud of the Dockerfile in ``context`` with layer caching; returns the build log."""
    done = buildah("bud", "--isolation", "chroot", "--layers", "--pull=never", "--build-arg", f"BASE_IMAGE={base}",
                   "--build-arg", "MEGARL_REVISION=container-test", *network_mounts(tmp), "-t", tag, str(context),
                   timeout=1500)
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def base():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    driver, root = storage()
    env = dict(os.environ, BUILDAH_ROOT=root, STORAGE_DRIVER=driver)
    done = subprocess.run(["bash", os.path.join(ROOT, "docker", "stand-in-base.sh")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image(base, tmp_path_factory):
    log = build(ROOT, base, tmp_path_factory.mktemp("build"))
    return IMAGE, log


def oci(name: str) -> dict:
    """The image's OCI configuration (config, rootfs.diff_ids, history)."""
    return json.loads(buildah("inspect", "--type", "image", name).stdout)["OCIv1"]


@pytest.fixture(scope="module")
def config(image) -> dict:
    return oci(image[0])["config"]


@pytest.fixture(scope="module")
def container(image):
    """One working container of the image for every run below (a vfs copy costs a minute)."""
    name = buildah("from", "--pull=never", image[0]).stdout.strip().splitlines()[-1]
    yield name
    buildah("rm", name, check=False)


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    """A host folder owned by the host user, mounted at /runs."""
    path = tmp_path_factory.mktemp("runs")
    uid, gid = map(int, USER.split(":"))
    os.chown(path, uid, gid)
    return path


def run_in(container, config, host_dir, *command, user=USER, timeout=900):
    """As `docker run --user USER -v HOST_DIR:/runs IMAGE COMMAND`: the image's entrypoint runs COMMAND."""
    entry = config.get("Entrypoint") or []
    # --hostname localhost: buildah, unlike Docker, leaves the container's own name out of
    # /etc/hosts, and torchrun's rendezvous looks it up
    return buildah("run", "--isolation", "chroot", "--hostname", "localhost", "--user", user,
                   "-v", f"{host_dir}:/runs", container, "--",
                   *entry, *command, timeout=timeout, check=False)


def test_labels_entrypoint_and_size(image, config, capsys):
    setup_version = re.search(r'version="([^"]+)"', open(os.path.join(ROOT, "setup.py")).read()).group(1)
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == setup_version
    assert labels["org.opencontainers.image.revision"] == "container-test"
    assert labels["org.opencontainers.image.base.name"].startswith("localhost/megarl-stand-in-base:")
    assert "org.opencontainers.image.source" in labels
    assert config["Entrypoint"] == ["/usr/local/bin/megarl-entrypoint"]
    assert config["Cmd"] == ["python", "launch/ppo.py", "--help"] and config["WorkingDir"] == "/opt/megarl"
    size = buildah("images", "--format", "{{.Size}}", image[0]).stdout.strip()
    with capsys.disabled():
        print(f"\nimage {image[0]}: {size} (on the stand-in base; NVIDIA's base adds its CUDA stack)")


def test_default_command_prints_the_config_keys(container, config, host_dir):
    done = run_in(container, config, host_dir, *config["Cmd"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainer.steps" in done.stdout


def test_smoke_test_as_a_non_root_user(container, config, host_dir):
    """The Dockerfile's smoke-test RUN lines again, as the host user outside the build."""
    text = open(os.path.join(ROOT, "Dockerfile")).read().replace("\\\n", "")
    smoke = text[text.index("# Smoke test"):].split("\nENTRYPOINT")[0]
    lines = [line[len("RUN "):] for line in smoke.splitlines() if line.startswith("RUN ")]
    assert len(lines) == 2, lines
    for line in lines:
        done = run_in(container, config, host_dir, "sh", "-c", line)
        assert done.returncode == 0, line + "\n" + done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def ppo_run(container, config, host_dir):
    done = run_in(container, config, host_dir, "torchrun", "--nproc_per_node", "2", "launch/ppo.py", "yaml/tiny.yaml",
                  "trainer.steps=2", "trainer.run_dir=/runs/ppo", *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return host_dir / "ppo"


def test_tiny_ppo_two_processes_writes_the_host_users_files(ppo_run, host_dir):
    steps = sorted({json.loads(line)["step"] for line in open(ppo_run / "metrics.jsonl")})
    assert steps[-1] == 2 and 1 in steps
    assert (ppo_run / "hf" / "config.json").is_file()
    uid, gid = map(int, USER.split(":"))
    for dirpath, dirnames, filenames in os.walk(host_dir):
        for name in dirnames + filenames:
            st = os.stat(os.path.join(dirpath, name))
            assert (st.st_uid, st.st_gid) == (uid, gid), os.path.join(dirpath, name)
            assert st.st_mode & 0o400, os.path.join(dirpath, name)


def test_convert_round_trip_gives_back_the_same_tensors(ppo_run, container, config, host_dir):
    from safetensors.torch import load_file

    for command in (["hf-to-mcore", "--hf", "/runs/ppo/hf", "--out", "/runs/mcore"],
                    ["mcore-to-hf", "--ckpt", "/runs/mcore", "--out", "/runs/hf2"]):
        done = run_in(container, config, host_dir, "python", "launch/convert.py", *command)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    def tensors(folder):
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    before, after = tensors(ppo_run / "hf"), tensors(host_dir / "hf2")
    assert before and before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and before[key].equal(after[key]), key


def test_source_change_reuses_the_dependency_layers(image, base, tmp_path):
    """A changed source file rebuilds from the source COPY on: pip's dependency install is cached."""
    context = tmp_path / "context"
    shutil.copytree(ROOT, context, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info",
                                                                  "runs", "build", ".pytest_cache"))
    with open(context / "megarl" / "__init__.py", "a") as f:
        f.write(f"\nSOURCE_CHANGE = {time.time()!r}  # new each run: never in the layer cache\n")
    log = build(context, base, tmp_path, tag=f"{IMAGE}-changed")
    steps = re.split(r"\nSTEP \d+/\d+: ", "\n" + log)
    deps = next(s for s in steps if s.startswith("RUN pip install /opt/megarl"))
    assert "Using cache" in deps, deps[-2000:]
    source = next(s for s in steps if s.startswith("RUN pip install --no-deps -e ."))
    assert "Using cache" not in source, source[-2000:]
    first, changed = (oci(name)["rootfs"]["diff_ids"] for name in (image[0], f"{IMAGE}-changed"))
    # base, setup.py, dependencies, SGLang (none), entrypoint: shared; the source and what follows: new
    assert len(first) == len(changed) == 9 and first[:5] == changed[:5] and first[5] != changed[5]
    buildah("rmi", f"{IMAGE}-changed", check=False)


def test_oci_archive_for_apptainer_and_enroot(image, tmp_path, capsys):
    archive = tmp_path / "megarl.oci.tar"
    # -D: no recompression (quicker here); users keep buildah's default (launch/slurm/README.md)
    buildah("push", "-D", image[0], f"oci-archive:{archive}:megarl:latest", timeout=900)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert {"oci-layout", "index.json"} <= names
        index = json.load(tar.extractfile("index.json"))
        manifest_ref = index["manifests"][0]
        assert manifest_ref["annotations"]["org.opencontainers.image.ref.name"] == "megarl:latest"
        blob = lambda digest: json.load(tar.extractfile("blobs/sha256/" + digest.split(":")[1]))  # noqa: E731
        manifest = blob(manifest_ref["digest"])
        oci_config = blob(manifest["config"]["digest"])
    assert oci_config["config"]["Entrypoint"] == ["/usr/local/bin/megarl-entrypoint"]
    assert oci_config["config"]["Labels"]["org.opencontainers.image.version"]
    assert len(manifest["layers"]) == len(oci_config["rootfs"]["diff_ids"]) >= 4
    with capsys.disabled():
        print(f"\nOCI archive: {archive.stat().st_size / 2**30:.2f} GiB, {len(manifest['layers'])} layers")
