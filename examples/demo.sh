#!/usr/bin/env bash
# The whole job on a small generated model: publisher (keygen, split, sign), auditor (audit),
# operator (verify-and-run), then a poisoned expert layer refused by both.
set -euo pipefail
cd "$(dirname "$0")/.."
D=demo
rm -rf "$D"
mkdir -p "$D"
step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

step "1. a small Hugging Face Mixtral-style checkpoint (random weights, real layout and tokenizer)"
python examples/make_tiny_moe.py "$D/hf" --family mixtral --layers 4 --experts 8 --experts-per-tok 2 --hidden 128
ls "$D/hf"

step "2. publisher key (PKCS#8 encrypted with scrypt, mode 0600)"
# The passphrase file is as secret as the key: created owner-only (keygen and sign refuse anything wider).
(umask 077 && printf 'demo passphrase, not a secret\n' > "$D/passphrase")
shardtool keygen --out "$D/publisher" --passphrase-file "$D/passphrase"

step "3. split into one file per expert plus trunk files, with an unsigned manifest"
shardtool split "$D/hf" "$D/model" --model-id demo/tiny-moe --version 1
find "$D/model" -type f | sort | head -12
echo "... $(find "$D/model" -type f | wc -l) files" >&2

step "4. sign the manifest"
shardtool sign "$D/model" --key "$D/publisher.key" --passphrase-file "$D/passphrase"

step "5. the resource contract the manifest now carries"
shardtool inspect "$D/model" --disk-gbps 3

step "6. audit the directory against the signed manifest"
shardtool audit "$D/model" --trust "$D/publisher.pub" --model-id demo/tiny-moe --state-dir "$D/state"

step "7. verify-and-run: every shard checked before its weights are used"
verify-and-run "$D/model" --trust "$D/publisher.pub" --model-id demo/tiny-moe --state-dir "$D/state" --memory-budget 64MiB \
    --prompt "The quick brown fox" --max-new-tokens 24 --temperature 0

step "8. poison layer 0's experts (one byte each) and try again"
python - "$D/model" <<'PY'
import pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1], "experts/layer-000").glob("*.safetensors")):
    data = bytearray(p.read_bytes()); data[-1] ^= 0x01; p.write_bytes(bytes(data))
PY
set +e
verify-and-run "$D/model" --trust "$D/publisher.pub" --model-id demo/tiny-moe --state-dir "$D/state" --memory-budget 64MiB \
    --prompt "The quick brown fox" --max-new-tokens 24
run_rc=$?
shardtool audit "$D/model" --trust "$D/publisher.pub" --model-id demo/tiny-moe --state-dir "$D/state" --quiet
audit_rc=$?
set -e
if [ "$run_rc" -ne 1 ] || [ "$audit_rc" -ne 1 ]; then
    echo "demo: FAILED: the tampered model was not refused (verify-and-run $run_rc, audit $audit_rc)" >&2
    exit 1
fi
step "refused by verify-and-run (exit $run_rc) and audit (exit $audit_rc), as it should be"
