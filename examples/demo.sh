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

step "8. serve it: an OpenAI-compatible server, one streamed chat request, then stop it"
shardtool serve "$D/model" --trust "$D/publisher.pub" --model-id demo/tiny-moe --state-dir "$D/state" \
    --memory-budget 128MiB --max-context 256 --port 0 2> "$D/serve.log" &
serve_pid=$!
trap 'kill "$serve_pid" 2>/dev/null || true' EXIT
url=""
for _ in $(seq 1 300); do
    url=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$D/serve.log" | head -n 1 || true)
    [ -n "$url" ] && break
    kill -0 "$serve_pid" 2>/dev/null || { cat "$D/serve.log" >&2; echo "demo: FAILED: serve exited" >&2; exit 1; }
    sleep 0.1
done
[ -n "$url" ] || { cat "$D/serve.log" >&2; echo "demo: FAILED: serve did not start" >&2; exit 1; }
echo "listening on $url"
curl -sS --fail-with-body -N "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "demo/tiny-moe", "stream": true, "max_tokens": 16, "temperature": 0,
         "messages": [{"role": "user", "content": "The quick brown fox"}]}' > "$D/chat.sse"
head -n 3 "$D/chat.sse"
python - "$D/chat.sse" <<'PY'
import json, sys
events = [line[6:] for line in open(sys.argv[1]) if line.startswith("data: ")]
assert events[-1].strip() == "[DONE]", "the stream did not end with [DONE]"
chunks = [json.loads(e) for e in events[:-1]]
text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
print(f"... {len(chunks)} server-sent events, then [DONE]; the reply: {text!r}")
PY
kill "$serve_pid"
wait "$serve_pid" || { echo "demo: FAILED: serve did not stop cleanly" >&2; exit 1; }
trap - EXIT

step "9. poison layer 0's experts (one byte each) and try again"
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
