"""Typed run configuration: one dataclass per section.

``yaml/`` files and ``key.sub=value`` overrides only fill these; the docs
given to :func:`opt` are what ``launch/<entry>.py --help`` prints. Loading,
type checks and "did you mean" live in :mod:`megarl.cli`; the cross-field
checks of each section live in :mod:`megarl.config_checks`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megarl.assets import TINY_DIR

REDIS_URL = "redis://127.0.0.1:6379/0"  # reward.redis_url default

ASSETS = str(TINY_DIR)  # shipped with the package: defaults work from any directory


def opt(default: Any, doc: str):
    """A config field with its one-line doc (mutable defaults are copied)."""
    if isinstance(default, (list, dict)) or hasattr(default, "__dataclass_fields__"):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    """The policy model (actor, and reference unless ref.path is set)."""

    path: str = opt(f"{ASSETS}/sft", "Hugging Face model directory (config.json + safetensors) or hub id (org/name[@revision]), fetched into the HF cache")
    tokenizer: Optional[str] = opt(None, "tokenizer directory; default: model.path")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "parameter dtype")
    attention_backend: Literal["sdpa", "local"] = opt("sdpa", "core attention: PyTorch SDPA or megatron's unfused softmax")
    layer_spec: Literal["auto", "local", "te"] = opt("auto", "auto: transformer-engine when it imports, else local")
    vocab_divisible_by: int = opt(128, "pad the vocabulary to a multiple of this times tp")
    moe_experts: Literal["auto", "grouped", "sequential"] = opt("auto", "mixture of experts: the routed experts' module; auto: GroupedMLP (grouped GEMMs, torch._grouped_mm) on CUDA in bfloat16, else SequentialMLP (a loop over local experts); grouped on CUDA needs bfloat16")


@dataclass
class ParallelConfig:
    """How the world is split: world = dp * tp * pp * cp."""

    tp: int = opt(1, "tensor-parallel size")
    pp: int = opt(1, "pipeline-parallel size")
    cp: int = opt(1, "context-parallel (Ulysses sequence-parallel) size")
    ep: int = opt(1, "expert-parallel size (mixture-of-experts models): each of ep ranks holds num_experts / ep experts; tokens reach them by alltoall")
    etp: Optional[int] = opt(None, "expert tensor-parallel size: each expert's FFN split over etp ranks; default: parallel.tp (ep * etp must divide world / pp)")
    sequence_parallel: bool = opt(False, "megatron sequence parallelism inside the TP group")
    distributed_optimizer: bool = opt(True, "shard optimizer state over data-parallel ranks")
    dp_balance: bool = opt(True, "deal each training forward's and mini-batch's rows over the DP ranks by token count (LPT) so every rank runs about as many tokens; false: each rank keeps its own rows")


@dataclass
class OptimConfig:
    """Adam with warmup, then constant or cosine decay."""

    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "final learning rate of the cosine decay")
    weight_decay: float = opt(0.0, "decoupled weight decay")
    betas: list[float] = opt([0.9, 0.999], "Adam betas")
    eps: float = opt(1e-8, "Adam epsilon")
    clip_grad: float = opt(1.0, "global gradient-norm clip; 0 disables")
    warmup_steps: int = opt(0, "linear warmup optimizer steps")
    decay: Literal["constant", "cosine"] = opt("constant", "schedule after warmup")
    cpu_offload: bool = opt(False, "megatron-core's optimizer CPU offload: Adam moments and the update live in host memory (HybridDeviceOptimizer; GPU keeps the weights and the fp32 master shard); needs parallel.distributed_optimizer=true")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (megarl/rollout/agent.py): the model calls tools and continues."""

    enable: bool = opt(False, "generate conversations: tool calls run and their results are appended (loss mask 0)")
    tools: list[str] = opt(["calculator"], "tools by name (calculator, python) or module:function returning a Tool")
    parser: str = opt("hermes", "tool-call parser: hermes (<tool_call>{json}</tool_call>) or module:function")
    tool_call_end: str = opt("</tool_call>", "the token that ends a tool call (one token of the tokenizer)")
    max_turns: int = opt(4, "assistant turns per sample")
    max_tool_output_tokens: int = opt(256, "tokens per tool result; longer ones are cut with a note")
    tool_timeout_s: float = opt(10.0, "wall seconds per tool call")
    tool_workers: int = opt(8, "tool calls running at once (threads; the python tool runs in a subprocess)")
    interaction: str = opt("", "simulated user: module:function(messages) -> next user message or None; empty: none")
    environment: str = opt("", "gym-style environment factory module:function (a class works), one per sample: reset(sample) -> opening messages, step(messages) -> (observation messages, reward, done); it answers every turn (tool calls reach it as OpenAI tool_calls; tools and interaction unused), the rewards' sum is the reward term 'agent'; tool_workers / tool_timeout_s bound its calls")
    overlap_tools: bool = opt(True, "a sample's tool calls start when its turn ends and its next turn joins the running batch when they return (rollout.engine=native); false: turn by turn, every sample waits for the slowest (same tokens)")


@dataclass
class SGLangConfig:
    """rollout.engine=sglang: one SGLang engine per TP group (megarl/rollout/sglang.py, sglang==0.5.23)."""

    mem_fraction_static: float = opt(0.5, "share of the GPU memory free when SGLang starts (after the trainer's models load) that it takes for its weights and KV cache (trainer.mode=async: of a rollout rank's GPU; a reward model there gets the rest)")
    dtype: Literal["bfloat16", "float16"] = opt("bfloat16", "SGLang's dtype (its Hopper attention needs 16-bit); the weights are cast to it when streamed, whatever model.dtype is")
    deterministic: bool = opt(False, "SGLang's deterministic inference: per-request seeds are honoured (slower kernels; at TP > 1 SGLang pins NCCL_ALGO for its workers)")
    enable_memory_saver: bool = opt(True, "release SGLang's memory during training and map it back for rollout (trainer.mode=sync; the async rollout ranks never release it: nothing trains there)")
    weights_cpu_backup: bool = opt(False, "SGLang keeps a CPU copy of its weights while released; false: they are streamed again before the next rollout (trainer.mode=sync, as enable_memory_saver)")
    start_timeout_s: float = opt(1800.0, "how long the other TP ranks wait for TP rank 0 to start SGLang")
    max_running_requests: int = opt(0, "requests SGLang runs at once; 0: its default")
    update_bucket_mb: float = opt(512.0, "weight-sync bucket size in MiB (trainer.mode=sync; async: the pushed buckets of async.bucket_mb go in as they arrive)")


@dataclass
class ServerConfig:
    """Agents in their own code behind an OpenAI endpoint on the engine (megarl/rollout/http_agents.py)."""

    enable: bool = opt(False, "each sample is an agent function that calls /v1/chat/completions on a local port during the rollout")
    agent: str = opt("", "module:function(sample, base_url) -> reward float or dict (with 'reward'); run once per sample")
    environment: str = opt("", "instead of agent: a gym-style environment class module:Name (reset(sample) -> messages, step(messages) -> (observation messages, reward, done)), one per sample, driven by megarl/agents/environment.py")
    max_turns: int = opt(4, "model turns per environment episode (rollout.server.environment)")
    host: str = opt("127.0.0.1", "address the endpoint binds (keep it local: it has no authentication)")
    port: int = opt(0, "port the endpoint binds; 0: a free one (each DP rank runs its own)")
    workers: int = opt(64, "agents running at once (threads, over all agent_processes)")
    agent_processes: int = opt(0, "0: agents run on threads of the trainer's process, sharing its interpreter lock with the engine's loop; N: on N worker processes (spawned once), so agent code (its OpenAI client, its tools) runs beside the engine; the agent must then be importable and its result picklable")
    timeout_s: float = opt(300.0, "wall seconds the agents of one rollout may take; later ones are failed samples")
    model_name: str = opt("megarl-policy", "the model name calls must send")
    parser: str = opt("hermes", "tool-call parser turning sampled text into OpenAI tool_calls: hermes or module:function")
    tool_call_end: str = opt("</tool_call>", "a token that ends a turn besides eos (the call then returns its tool_calls); empty: none")


@dataclass
class RolloutConfig:
    """Generation of responses by the rollout engine."""

    engine: Literal["native", "sglang"] = opt("native", "native: decoding on the actor's own Megatron weights; sglang: an SGLang engine per TP group (where installed)")
    multi_turn: MultiTurnConfig = opt(MultiTurnConfig(), "multi-turn rollouts with tools")
    sglang: SGLangConfig = opt(SGLangConfig(), "SGLang engine options (rollout.engine=sglang)")
    server: ServerConfig = opt(ServerConfig(), "OpenAI-compatible endpoint for agents written as plain code")
    n: int = opt(1, "responses sampled per prompt")
    max_new_tokens: int = opt(16, "response length limit (multi-turn: sampled plus appended tool/user tokens)")
    temperature: float = opt(1.0, "sampling temperature; 0 means greedy")
    top_p: float = opt(1.0, "nucleus sampling mass")
    top_k: int = opt(-1, "top-k sampling; -1 disables")
    stop_token_ids: list[int] = opt([], "extra stop tokens besides the tokenizer's eos")
    ignore_eos: bool = opt(False, "never stop early: every response is max_new_tokens long (benchmarks)")
    max_batch: int = opt(256, "sequences decoding at once per engine (continuous batching refills finished slots)")
    max_num_batched_tokens: int = opt(8192, "new tokens per chunked-prefill step: prompt chunks plus, in a mixed step, one per running sequence")
    mixed_prefill: bool = opt(True, "a prefill step also decodes one token of every running sequence, so a refill does not stop the decode; false: prefill and decode steps alternate")
    page_size: int = opt(16, "tokens per KV-cache page (a power of two, 8..128)")
    kv_cache_gb: float = opt(0.0, "KV-cache budget in GiB; 0: rollout.kv_cache_fraction of free memory")
    kv_cache_fraction: float = opt(0.5, "share of free device memory (CPU: available RAM) the KV cache may take")
    cuda_graphs: bool = opt(True, "replay the decode step as CUDA graphs on CUDA; false: eager")
    record_experts: bool = opt(False, "MoE model: keep every prompt and response token's top-k expert ids per MoE layer in the result (native engine: in CUDA graphs too, and tokens reused from rollout.prefix_cache carry the ids of the forward that computed their K/V; sglang: SGLang's routed-experts capture, the same for its radix cache)")
    prefix_cache: bool = opt(False, "reuse full K/V pages of equal token prefixes (a request prefilled after another that starts the same way; a conversation's earlier turns) until the weights change (with rollout.record_experts a page keeps its tokens' expert ids too); off: every call starts cold, so results never depend on earlier calls")
    seed: int = opt(1234, "sampling seed (identical across a TP group)")
    partial: bool = opt(False, "partial rollouts: a step stops generating once enough whole groups (a prompt's n samples) have finished to fill the batch; unfinished responses keep their tokens and resume in the next step under the new weights (each token records the policy version that sampled it; native engine; pair with algorithm.rollout_correction.preset=async)")
    partial_batches: int = opt(2, "rollout.partial: batches of data.batch_size prompts in flight per step (each step tops up with new batches to this many); >= 2, since a step trains one batch's worth")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor's linears (megarl/models/lora.py); rank 0: full fine-tuning."""

    rank: int = opt(0, "adapter rank r; 0 disables LoRA")
    alpha: float = opt(16.0, "scale alpha: the adapter adds (alpha / r) * x A^T B^T")
    targets: list[str] = opt(list(LORA_TARGETS), "megatron linears to adapt")
    experts: bool = opt(False, "mixture of experts: also adapt every routed expert's fc1 / fc2 (an A / B pair per expert, run as grouped GEMMs on GroupedMLP and as hooks on SequentialMLP's per-expert linears); false: attention, dense and shared-expert MLPs only")


@dataclass
class ActorConfig:
    """Policy update."""

    optim: OptimConfig = opt(OptimConfig(), "optimizer")
    lora: LoraConfig = opt(LoraConfig(), "LoRA adapters (rank 0: off); checkpoints keep them, the HF export merges them")
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    mini_batch_size: int = opt(32, "samples per optimizer step (global, all DP ranks)")
    micro_batch_size: int = opt(8, "samples per forward/backward per GPU")
    forward_micro_batch_size: int = opt(0, "samples per forward-only pass per GPU (old and reference log-probs); 0: micro_batch_size. These passes keep no activations, so larger ones fit (verl: log_prob_micro_batch_size_per_gpu)")
    max_tokens_per_micro: int = opt(0, "dynamic micro-batches under this token budget; 0 uses micro_batch_size")
    packing: bool = opt(True, "actor and reference run each micro-batch as one packed THD row (no padding); false: right-padded rows")
    recompute: Literal["none", "selective", "full"] = opt("none", "activation recompute in the update (megatron's): none | selective (core attention recomputed in backward) | full (every layer's input kept, the layer recomputed); forward-only passes never recompute")
    policy_loss: str = opt("ppo", "ppo | gspo | a registered name or module:function")
    clip_low: float = opt(0.2, "ratio clip below: 1 - clip_low")
    clip_high: float = opt(0.2, "ratio clip above: 1 + clip_high")
    gspo_clip_low: float = opt(3e-4, "gspo: sequence-ratio clip below: 1 - gspo_clip_low (GSPO paper: 3e-4)")
    gspo_clip_high: float = opt(4e-4, "gspo: sequence-ratio clip above: 1 + gspo_clip_high (GSPO paper: 4e-4)")
    dual_clip: float = opt(0.0, "dual-clip bound c (> 1) for negative advantages; 0 disables")
    entropy_coef: float = opt(0.0, "entropy bonus weight")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = opt("token-mean", "how token losses become one number")
    kl_loss_coef: float = opt(0.0, "weight of KL(policy || ref) added to the loss; 0 disables")
    kl_loss_estimator: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = opt("low_var_kl", "KL estimator for the loss term")
    moe_aux_loss_coef: float = opt(0.0, "mixture of experts: load-balancing loss weight (megatron's aux_loss); RL recipes keep 0: it pulls the router toward uniform load against the policy gradient, and the router must keep routing as the policy that generated the rollouts did")
    moe_z_loss_coef: float = opt(0.0, "mixture of experts: router z-loss weight (penalizes large router logits); 0: off")
    router_replay: Literal["none", "r3"] = opt("none", "mixture of experts: r3 (rollout routing replay) routes every prompt and response token of the old-log-prob, reference and update forwards to the experts the rollout used (recorded by the native engine, which r3 turns on: rollout.record_experts); gate weights still from the current router; none: the router chooses")
    router_replay_probe_every: int = opt(1, "r3: every this many steps one extra forward-only pass without replay logs mismatch/no_replay/* and r3/no_replay/agreement beside the replayed pass's; 0: never")


@dataclass
class CriticConfig:
    """Value model: a value head on a transformer."""

    enable: Optional[bool] = opt(None, "train a critic; default: when algorithm.advantage needs values (gae)")
    path: Optional[str] = opt(None, "HF directory for the critic; default: model.path with a fresh value head")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "optimizer")
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    micro_batch_size: int = opt(8, "samples per forward/backward per GPU")
    forward_micro_batch_size: int = opt(0, "samples per forward-only pass per GPU (values before the update); 0: micro_batch_size")
    packing: bool = opt(True, "run each micro-batch as one packed THD row (no padding); false: right-padded rows")
    recompute: Literal["none", "selective", "full"] = opt("none", "activation recompute in the update: none | selective (core attention) | full (whole layers), as actor.recompute")
    value_clip: float = opt(0.2, "clip of the new value around the old; 0 disables")
    warmup_steps: int = opt(0, "PPO steps that update only the critic")


@dataclass
class RefConfig:
    """Frozen reference policy for the KL term."""

    enable: Optional[bool] = opt(None, "keep a reference model; default: when any KL term is on")
    path: Optional[str] = opt(None, "HF directory; default: model.path")


@dataclass
class RewardTerm:
    """One weighted term of the composite reward."""

    name: str = opt("math", "a registered reward (format, math, ...) or module:function")
    weight: float = opt(1.0, "weight in the sum")
    kwargs: dict = opt({}, "keyword arguments for the reward function")
    cache: Optional[bool] = opt(None, "serve this term from the reward cache (keyed on prompt, response, answer and extra); default: registered rewards yes, module:function ones no (set true for a pure function)")


@dataclass
class RewardModelConfig:
    """A value-head model that scores whole responses."""

    path: Optional[str] = opt(None, "HF *ForSequenceClassification (or causal LM) directory; unset: no RM")
    weight: float = opt(1.0, "weight in the sum")
    scale: float = opt(1.0, "the RM's raw score is multiplied by this")
    clip: Optional[list[float]] = opt(None, "[low, high] clip of the scaled score, e.g. [0, 5]")
    micro_batch_size: int = opt(8, "samples per forward per GPU")
    packing: bool = opt(True, "score each micro-batch as one packed THD row (no padding); false: right-padded rows")


@dataclass
class RewardConfig:
    """How responses are scored."""

    terms: list[RewardTerm] = opt([RewardTerm()], "rule-based or user reward terms")
    model: RewardModelConfig = opt(RewardModelConfig(), "reward model term")
    fallback: float = opt(0.0, "score given to a sample whose reward function raised or returned NaN")
    cache: Literal["memory", "sqlite", "redis"] = opt("memory", "memory (per process) | sqlite (cache_path: shared by the ranks, kept across runs) | redis (redis_url: shared across nodes; written through to cache_path, which takes over if Redis dies)")
    cache_size: int = opt(65536, "entries in the in-process LRU (sqlite | redis: in front of the store); 0 disables the reward cache")
    cache_path: Optional[str] = opt(None, "sqlite | redis: the on-disk store (a local disk; delete it after changing a reward function); default <trainer.run_dir>/reward_cache.sqlite")
    redis_url: str = opt(REDIS_URL, "redis: the server, redis://host:port/db (or rediss://, unix://); start one with redis-server --port 6379 --daemonize yes")


@dataclass
class RolloutCorrectionConfig:
    """Importance weights / masks for tokens the rollout engine sampled (megarl/algos/rollout_correction.py)."""

    preset: Literal["none", "sglang", "async"] = opt("none", "none: the keys below; sglang: tis with cap 2 (another engine's rounding); async: icepop in [0.5, 2] (stale tokens); a preset leaves the keys below at their defaults")
    mode: Literal["none", "tis", "seq_is", "mis", "icepop"] = opt("none", "none | tis (token weights min(ratio, cap)) | seq_is (sequence weight min(ratio, cap)) | mis (drop tokens or sequences outside [low, high]) | icepop (drop tokens outside [low, high], weight the rest by their ratio)")
    cap: float = opt(2.0, "tis / seq_is: the weight cap C (>= 1)")
    level: Literal["token", "sequence"] = opt("token", "mis: drop single tokens or whole sequences")
    seq_ratio: Literal["product", "geo_mean"] = opt("geo_mean", "seq_is and mis at sequence level: the sequence ratio is the product or the geometric mean of its token ratios")
    low: float = opt(0.5, "mis / icepop: lower end of the kept band, in (0, 1)")
    high: float = opt(2.0, "mis / icepop: upper end of the kept band, > 1")


@dataclass
class DapoConfig:
    """DAPO's dynamic sampling and overlong shaping (megarl/algos/dapo.py, megarl/trainer/dapo.py)."""

    dynamic_sampling: bool = opt(False, "drop prompt groups whose scores are all equal (no group-advantage signal) and generate more prompts until the batch is full")
    max_rounds: int = opt(4, "dynamic sampling: generation rounds per step at most, the first included; a batch still short is filled with dropped groups (dapo/groups_filled)")
    overlong_buffer: int = opt(0, "L_cache: responses longer than rollout.max_new_tokens - L_cache lose score linearly, up to overlong_penalty at max_new_tokens; 0 disables")
    overlong_penalty: float = opt(1.0, "the overlong penalty at rollout.max_new_tokens tokens (DAPO: 1)")
    mask_truncated: bool = opt(False, "responses cut at rollout.max_new_tokens get no loss (their scores still count in their group)")


@dataclass
class AlgorithmConfig:
    """Advantages and the KL penalty."""

    advantage: str = opt("gae", "gae | grpo | rloo | reinforce_pp | reinforce_pp_baseline | remax | module:function")
    gamma: float = opt(1.0, "discount")
    lam: float = opt(1.0, "GAE lambda")
    norm_by_std: bool = opt(True, "grpo: divide by the group std (False gives Dr.GRPO)")
    whiten: bool = opt(True, "gae / reinforce_pp: whiten advantages over the batch")
    kl_in_reward: bool = opt(False, "subtract beta * KL(policy || ref) from the token rewards")
    kl_estimator: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = opt("k1", "KL estimator for the reward penalty")
    kl_controller: Literal["fixed", "adaptive"] = opt("fixed", "beta stays fixed or tracks kl_target")
    kl_coef: float = opt(0.001, "beta: initial KL coefficient")
    kl_target: float = opt(6.0, "adaptive controller: target KL")
    kl_horizon: int = opt(10000, "adaptive controller: horizon in samples")
    rollout_correction: RolloutCorrectionConfig = opt(RolloutCorrectionConfig(), "rollout correction (TIS / MIS / icepop): off by default")
    dapo: DapoConfig = opt(DapoConfig(), "DAPO: dynamic sampling, overlong shaping, truncated responses masked")


@dataclass
class DataSource:
    """One training set of data.train_mix."""

    path: str = opt("", "a .jsonl / .json / .parquet file, a datasets save_to_disk directory, or a hub dataset name")
    weight: float = opt(1.0, "share of the training samples drawn from this set (the weights are normalized)")
    split: str = opt("train", "split of a saved DatasetDict or a hub dataset")
    subset: Optional[str] = opt(None, "configuration name of a hub dataset (e.g. main for openai/gsm8k)")
    prompt_key: Optional[str] = opt(None, "this set's prompt column; default data.prompt_key")
    answer_key: Optional[str] = opt(None, "this set's ground-truth column; default data.answer_key")
    row_map: Optional[str] = opt(None, "this set's module:function row map; default data.row_map")


@dataclass
class EvalSet:
    """One named evaluation set (data.eval_sets): logged as eval/<name>/pass@k and eval/<name>/mean@n."""

    name: str = opt("", "the set's name in the metrics: eval/<name>/...")
    path: str = opt("", "a .jsonl / .json / .parquet file, a datasets save_to_disk directory, or a hub dataset name")
    split: str = opt("test", "split of a saved DatasetDict or a hub dataset")
    subset: Optional[str] = opt(None, "configuration name of a hub dataset")
    prompt_key: Optional[str] = opt(None, "this set's prompt column; default data.prompt_key")
    answer_key: Optional[str] = opt(None, "this set's ground-truth column; default data.answer_key")
    row_map: Optional[str] = opt(None, "this set's module:function row map; default data.row_map")
    n: int = opt(1, "samples per prompt")
    temperature: float = opt(0.0, "sampling temperature; 0: greedy (then n must be 1)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    k: list[int] = opt([], "pass@k logged for each k (each <= n); empty: 1 and n")
    metric: str = opt("math", "scores a sample: a registered reward (math, format, ...) or module:function with the reward signature")
    metric_kwargs: dict = opt({}, "keyword arguments for the metric function")
    pass_threshold: float = opt(1.0, "a sample counts as solved for pass@k when its score is >= this")
    limit: int = opt(0, "prompts evaluated (the first ones); 0: all")
    max_new_tokens: int = opt(0, "response length limit; 0: rollout.max_new_tokens")


@dataclass
class DataConfig:
    """Prompt data."""

    train_path: str = opt(f"{ASSETS}/train.jsonl", "prompts: a .jsonl / .json / .parquet file (prompt | messages, answer, extra), a datasets save_to_disk directory or a hub dataset name")
    eval_path: Optional[str] = opt(f"{ASSETS}/test.jsonl", "held-out prompts for accuracy (eval/accuracy, greedy, math answer); unset: none")
    train_split: str = opt("train", "split of train_path when it is a saved DatasetDict or a hub dataset")
    eval_split: str = opt("test", "split of eval_path when it is a saved DatasetDict or a hub dataset")
    subset: Optional[str] = opt(None, "configuration name of a hub dataset in train_path / eval_path (e.g. main)")
    train_mix: list[DataSource] = opt([], "several training sets mixed by weight, each {path, weight, split, subset, prompt_key, answer_key, row_map}; when set, train_path is not read")
    eval_sets: list[EvalSet] = opt([], "named evaluation sets, each {name, path, split, subset, prompt_key, answer_key, row_map, n, temperature, top_p, k, metric, metric_kwargs, pass_threshold, limit, max_new_tokens}: eval/<name>/pass@k, mean@n")
    prompt_key: str = opt("prompt", "column holding the prompt text (or chat messages), e.g. question (GSM8K) or problem (MATH)")
    answer_key: str = opt("answer", "column holding the ground truth, e.g. answer (GSM8K, '#### 42') or solution (MATH, \\boxed{})")
    row_map: str = opt("", "module:function(row: dict) -> dict with prompt (or messages), answer and other fields; replaces prompt_key / answer_key")
    batch_size: int = opt(32, "prompts per PPO step (global, all DP ranks)")
    max_prompt_len: int = opt(64, "longer prompts are filtered out and counted")
    apply_chat_template: bool = opt(True, "wrap prompts with the tokenizer's chat template")
    skip_malformed: bool = opt(False, "skip and count malformed rows instead of stopping")
    seed: int = opt(0, "shuffle seed")


@dataclass
class WandbConfig:
    """Weights & Biases logging from rank 0: the scalars TensorBoard gets, and the config (pip install megarl[wandb])."""

    enable: bool = opt(False, "log this run to W&B")
    project: str = opt("megarl", "W&B project")
    entity: str = opt("", "W&B team or user; empty: your default entity")
    name: str = opt("", "W&B run name; empty: the last component of trainer.run_dir")
    mode: Literal["online", "offline"] = opt("online", "online: stream to the W&B server; offline: files only (upload later with `wandb sync`)")
    dir: str = opt("", "where W&B writes its files (a wandb/ folder inside it); empty: trainer.run_dir")


@dataclass
class PlacementConfig:
    """Which ranks generate and which train when trainer.mode=async (the last rollout_ranks ranks generate)."""

    rollout_ranks: int = opt(1, "ranks that only generate, each with its own copy of the policy (trainer.mode=async); the other ranks train")
    rollout_tp: int = opt(1, "tensor-parallel size of the rollout ranks' policy copy; divides rollout_ranks (trainer.mode=async); the copy has no PP, EP (every expert, split over rollout_tp) or LoRA adapters (it receives W + s B A)")


@dataclass
class AsyncConfig:
    """The asynchronous pipeline (trainer.mode=async): written ``async.KEY`` in yaml and overrides."""

    max_staleness: int = opt(1, "policy versions a trained batch may lag: the batch of step k is sampled by weights of at least k - max_staleness updates; a rollout rank never generates with older ones (it waits for the next weights: async/rollout_waits); with rollout.partial it bounds every trained token's version (older carried responses are sampled again: partial/restarted_stale)")
    queue_size: int = opt(2, "rollout batches a rollout rank may have sent and the trainer not yet taken; a full queue waits like staleness does")
    bucket_mb: float = opt(64.0, "weights reach the rollout ranks in flat buckets of at most this many MiB (a bigger tensor gets its own)")


@dataclass
class TrainerConfig:
    """The loop, logging and checkpoints."""

    steps: int = opt(20, "PPO steps")
    mode: Literal["sync", "async"] = opt("sync", "sync: every rank generates then trains (colocated); async: placement.rollout_ranks ranks generate and score (reward model, ReMax baseline, DAPO rounds included) while the others train, weights pushed after each update (async.*)")
    run_dir: str = opt("runs/default", "config.yaml, metrics.jsonl, TensorBoard events, checkpoints and exports go here; default: runs/<the yaml file's name> (runs/default without a yaml)")
    seed: int = opt(42, "model-init and dropout seed")
    save_every: int = opt(0, "checkpoint every N steps; 0: only at the end (if save_last)")
    save_last: bool = opt(True, "checkpoint after the last step")
    keep_last: int = opt(2, "checkpoints kept")
    resume: bool | Literal["force"] = opt(True, "resume from the newest checkpoint in run_dir, refused when its config.yaml names another algorithm, model, critic or task; force: resume anyway; false: start over")
    collective_timeout_s: float = opt(600.0, "a collective (all-reduce, barrier, ...) waiting longer than this fails the job loudly: a rank whose peer died or hangs exits instead of waiting forever")
    eval_every: int = opt(0, "held-out evaluation every N steps; 0: before and after only")
    eval_samples: int = opt(0, "held-out prompts evaluated; 0: all")
    export_hf: bool = opt(True, "write the final actor as a Hugging Face directory")
    export_every: int = opt(0, "also write the actor as a Hugging Face directory RUN_DIR/exports/step_N every N steps (LoRA merged); 0: never")
    tensorboard: bool = opt(True, "write TensorBoard events")
    monitor_interval_s: float = opt(2.0, "resource monitor: seconds between CPU/RAM/GPU samples, logged per step as resources/*; 0 disables")
    dump_rollouts: Optional[str] = opt(None, "write each step's rollout batch to this directory")
    replay_rollouts: Optional[str] = opt(None, "train on rollouts dumped earlier instead of generating")
    rollout_only: bool = opt(False, "generate and score only; no training (use with dump_rollouts)")
    max_bad_updates: int = opt(3, "stop the run after this many optimizer updates in a row skipped for a non-finite loss or gradient (per role); 0: never stop")
    wandb: WandbConfig = opt(WandbConfig(), "Weights & Biases logging")


@dataclass
class SFTSource:
    """One training set of sft.train_mix."""

    path: str = opt("", "a .jsonl / .json / .parquet file, a datasets save_to_disk directory, or a hub dataset name")
    weight: float = opt(1.0, "share of the training rows drawn from this set (the weights are normalized)")
    split: str = opt("train", "split of a saved DatasetDict or a hub dataset")
    subset: Optional[str] = opt(None, "configuration name of a hub dataset")
    prompt_key: Optional[str] = opt(None, "this set's prompt column; default sft.prompt_key")
    response_key: Optional[str] = opt(None, "this set's response column; default sft.response_key")
    row_map: Optional[str] = opt(None, "this set's module:function row map; default sft.row_map")


@dataclass
class SFTConfig:
    """Supervised warm start (launch/sft.py); rows are templated and length-filtered as data.* says
    (data.apply_chat_template, data.system_prompt, data.max_prompt_len, data.skip_malformed)."""

    train_path: str = opt(f"{ASSETS}/sft.jsonl", "rows with a prompt (or messages) and a response: a .jsonl / .json / .parquet file, a datasets save_to_disk directory or a hub dataset name")
    train_split: str = opt("train", "split of train_path when it is a saved DatasetDict or a hub dataset")
    subset: Optional[str] = opt(None, "configuration name of a hub dataset in train_path (e.g. main)")
    train_mix: list[SFTSource] = opt([], "several training sets mixed by weight, each {path, weight, split, subset, prompt_key, response_key, row_map}; when set, train_path is not read")
    prompt_key: str = opt("prompt", "column holding the prompt text (or chat messages), e.g. question (GSM8K)")
    response_key: str = opt("response", "column holding the trained response text, e.g. answer (GSM8K)")
    row_map: str = opt("", "module:function(row: dict) -> dict with prompt (or messages) and the response column; replaces prompt_key")
    out_dir: str = opt("runs/sft", "where the trained Hugging Face model is written")
    init: Literal["pretrained", "random"] = opt("pretrained", "start from model.path weights or from a random init of its config")
    epochs: int = opt(1, "passes over the data (with train_mix: as many rows as all its sets hold, drawn by weight)")
    batch_size: int = opt(32, "samples per optimizer step (global)")
    micro_batch_size: int = opt(8, "samples per forward/backward per GPU")
    max_len: int = opt(64, "prompt + response tokens; longer rows are skipped and counted")
    optim: OptimConfig = opt(OptimConfig(lr=1e-3, warmup_steps=10, decay="cosine"), "optimizer")


@dataclass
class Config:
    """A whole megarl run."""

    model: ModelConfig = opt(ModelConfig(), "policy model")
    parallel: ParallelConfig = opt(ParallelConfig(), "parallel layout")
    rollout: RolloutConfig = opt(RolloutConfig(), "rollout engine")
    actor: ActorConfig = opt(ActorConfig(), "policy update")
    critic: CriticConfig = opt(CriticConfig(), "value model")
    ref: RefConfig = opt(RefConfig(), "reference policy")
    reward: RewardConfig = opt(RewardConfig(), "rewards")
    algorithm: AlgorithmConfig = opt(AlgorithmConfig(), "advantages and KL")
    data: DataConfig = opt(DataConfig(), "prompts")
    trainer: TrainerConfig = opt(TrainerConfig(), "loop and checkpoints")
    placement: PlacementConfig = opt(PlacementConfig(), "rollout and training ranks (trainer.mode=async)")
    async_: AsyncConfig = opt(AsyncConfig(), "asynchronous pipeline (trainer.mode=async); the key is async")
    sft: SFTConfig = opt(SFTConfig(), "supervised warm start")

    # inputs a yaml names relative to itself when not found from the working directory (megarl.cli)
    INPUT_PATH_KEYS = ("model.path", "model.tokenizer", "critic.path", "ref.path", "reward.model.path",
                       "data.train_path", "data.eval_path", "sft.train_path", "trainer.replay_rollouts",
                       "data.train_mix[].path", "data.eval_sets[].path", "sft.train_mix[].path")
    RUN_DIR_KEY = "trainer.run_dir"  # default: runs/<yaml file name> (megarl.cli.load_config)
