#!/usr/bin/env bash
# Times the kernels of git revisions against the working tree, in one run on one GPU:
# each version is copied to its own folder (its own builds, by content hash), then
# bench.py --quick --impls ours runs on each in turn, ROUNDS times, so drift between
# rounds shows up as the spread of one version's numbers. Every version runs the working
# tree's bench.py.
#   scripts/compare_revisions.sh CASES ROUNDS REV...     e.g. ce-,kl-16384 2 HEAD~1
# A REV that is a .patch file stands for the working tree with that patch applied, and one
# that is a directory for the tree in it (no git needed). The working tree is always the last version ("work"). Other REVs resolve in this
# checkout's .git, which on a copied tree can be older than the files (the device tool's
# copy had the session's first HEAD): what each stands for is printed first.
set -uo pipefail
cd "$(dirname "$0")/.."
cases=${1:?usage: scripts/compare_revisions.sh CASES ROUNDS REV...} rounds=${2:?ROUNDS}
shift 2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT  # also when a step fails
copy_working_tree() { mkdir -p "$1" && cp -r ./*.py kernels "$1/"; }  # the product: every root module and kernels/
names=()
for rev in "$@"; do
  if [[ $rev == *.patch ]]; then
    name=$(basename "$rev" .patch)
    copy_working_tree "$scratch/$name" && (cd "$scratch/$name" && git apply) < "$rev" || exit 1
  elif [[ -d $rev ]]; then
    name=$(basename "$rev")
    mkdir -p "$scratch/$name" && cp -r "$rev"/. "$scratch/$name/" && cp bench.py "$scratch/$name/" || exit 1
  else
    name=$rev
    echo "$rev: $(git log -1 --format='%h %s' "$rev")"
    mkdir -p "$scratch/$name" && git archive "$rev" | tar -x -C "$scratch/$name" || exit 1
    cp bench.py "$scratch/$name/"  # one measurement for every version: the working tree's
  fi
  names+=("$name")
done
copy_working_tree "$scratch/work" && names+=(work)
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || exit 1
for name in "${names[@]}"; do  # builds first, in parallel, so timing runs build nothing
  (cd "$scratch/$name" && python3 loader.py --arch "$arch" > "$scratch/build_$name.log" 2>&1) &
done
wait
for round in $(seq "$rounds"); do
  for name in "${names[@]}"; do
    (cd "$scratch/$name" && python3 bench.py --quick --no-first-use --impls ours --cases "$cases" --json "$scratch/$name.json" \
       --plot "$scratch/$name.png" 2>/dev/null | grep -E "^(ce|kl|mse)-" | sed "s/^/$name round $round  /")
  done
done
