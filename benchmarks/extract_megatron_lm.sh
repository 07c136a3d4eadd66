#!/usr/bin/env bash
# The files of Megatron-LM that pretrain_gpt.py imports, without megatron/core, for
# benchmarks/bench_peer.py: the pip-installed megatron-core (0.19.2 here) then serves megatron.core
# for both sides, so the comparison is of the training loops, not of two megatron-core versions.
#
#     bash benchmarks/extract_megatron_lm.sh <Megatron-LM git dir or checkout> <ref> <outdir>
#     bash benchmarks/extract_megatron_lm.sh ~/Megatron-LM core_r0.19.0 /tmp/megatron-lm
#     python benchmarks/bench_peer.py --megatron-lm /tmp/megatron-lm model=standard_attn size=h200 attention=unfused
#
# What pretrain_gpt.py imports from the repository (checked at core_r0.19.0): gpt_builders.py,
# model_provider.py and megatron/training/ (which imports only megatron.core and itself, plus
# megatron.rl and megatron.post_training inside try/except ImportError: left out, as is
# nvidia-modelopt). megatron/__init__.py must not exist at <ref>: `megatron` is then a namespace
# package, and the extract's megatron/training merges with site-packages' megatron/core, whichever
# comes first on sys.path. The script refuses a ref where it exists.
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: bash $0 <Megatron-LM git dir or checkout> <ref> <outdir>" >&2
    exit 2
fi
src=$1 ref=$2 out=$3
FILES=(pretrain_gpt.py gpt_builders.py model_provider.py megatron/training LICENSE)

git -C "$src" rev-parse --verify --quiet "$ref^{commit}" >/dev/null || {
    echo "error: $src has no commit $ref (a Megatron-LM git directory or checkout, and a branch, tag or commit)" >&2
    exit 1
}
if git -C "$src" cat-file -e "$ref:megatron/__init__.py" 2>/dev/null; then
    echo "error: $ref has megatron/__init__.py: megatron is a regular package there and would hide" \
         "the pip-installed megatron.core; this extract needs a ref without it (core_r0.19.0 has none)" >&2
    exit 1
fi
for f in "${FILES[@]}"; do
    git -C "$src" cat-file -e "$ref:$f" 2>/dev/null || { echo "error: $ref has no $f" >&2; exit 1; }
done
mkdir -p "$out"
git -C "$src" archive --format=tar "$ref" -- "${FILES[@]}" | tar -x -C "$out"
commit=$(git -C "$src" rev-parse "$ref^{commit}")
echo "$commit $ref" > "$out/MEGATRON_LM_COMMIT"
echo "extracted Megatron-LM $ref ($commit): ${FILES[*]} -> $out"
