#!/usr/bin/env bash
# Copies a git worktree's tracked and untracked-not-ignored files into .carry/<name> of
# the main checkout, which the device tool sends when a run names it in `carry`:
#   bash benchmarks/carry_worktree.sh /work/wt-fa fa
#   run(command="cd .carry/fa && JC_BUILD_DIR=/tmp/build-fa bash benchmarks/gpu_check.sh ...",
#       carry=[".carry/fa"])
set -euo pipefail
src=$1 name=$2
main=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
dest="$main/.carry/$name"
rm -rf "$dest" && mkdir -p "$dest"
git -C "$src" ls-files -co --exclude-standard -z | (cd "$src" && tar --null -cf - -T -) | tar -xf - -C "$dest"
du -sh "$dest"
