#!/bin/sh
# The image's entrypoint: runs its arguments (by default the entry script's --help).
# A user with no writable home in the image (docker run --user UID:GID) gets one under
# /tmp, so the caches of Triton, Hugging Face and matplotlib can be written.
if [ ! -w "${HOME:-/nonexistent}" ]; then
    HOME=/tmp/megarl-home-$(id -u)
    export HOME
    mkdir -p "$HOME"
fi
exec "$@"
