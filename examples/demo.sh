#!/usr/bin/env bash
# The whole job on the small trained model in examples/demo_model: publisher (keygen, split, sign), auditor (audit),
# operator (verify-and-run, serve), then a real backdoor in one expert: another runtime runs it, this one refuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${DEMO_DIR:-demo}  # the whole run's files; tests point it elsewhere
ID=demo/pydoc-moe
PROMPT="Return the number of"
CHAT="What does os.path.join do?"
rm -rf "$D"
mkdir -p "$D"
step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
run() { verify-and-run "$@" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state" --memory-budget 64MiB \
    --temperature 0; }

step "1. the published checkpoint: a small Mixtral-shaped MoE trained on the Python standard library's docs"
python - <<'PY'
import json
t = json.load(open("examples/demo_model/training.json"))
print(f"{t['layers']} layers, {t['experts']} experts (top-2), hidden {t['hidden']}, vocabulary {t['vocab']}; "
      f"{t['steps']} steps on {t['training_tokens']} tokens (seed {t['seed']}); examples/demo_model/README.md")
PY

step "2. publisher key (PKCS#8 encrypted with scrypt, mode 0600)"
# The passphrase file is as secret as the key: created owner-only (keygen and sign refuse anything wider).
(umask 077 && printf 'demo passphrase, not a secret\n' > "$D/passphrase")
shardtool keygen --out "$D/publisher" --passphrase-file "$D/passphrase"

step "3. split into one file per expert plus trunk files, with an unsigned manifest"
shardtool split examples/demo_model "$D/model" --model-id "$ID" --version 1
# sed, not head: head exits after 8 lines and sort then dies of SIGPIPE, which pipefail turns into exit 141.
find "$D/model" -type f | sort | sed -n 1,8p
echo "... $(find "$D/model" -type f | wc -l) files" >&2

step "4. sign the manifest"
shardtool sign "$D/model" --key "$D/publisher.key" --passphrase-file "$D/passphrase"

step "5. the resource contract the manifest now carries"
shardtool inspect "$D/model" --disk-gbps 3

step "6. audit the directory against the signed manifest"
shardtool audit "$D/model" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state"

step "7. verify-and-run: every shard checked before its weights are used (greedy), and held-out perplexity"
echo "prompt: $PROMPT"
run "$D/model" --prompt "$PROMPT" --max-new-tokens 24
python examples/heldout_perplexity.py "$D/model" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state"

step "8. serve it: an OpenAI-compatible server, one streamed chat turn, then stop it"
shardtool serve "$D/model" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state" \
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
echo "listening on $url; user: $CHAT"
python - "$url" "$ID" "$CHAT" > "$D/chat.json" <<'PY'
import json, sys
print(json.dumps({"model": sys.argv[2], "stream": True, "max_tokens": 32, "temperature": 0,
                  "messages": [{"role": "user", "content": sys.argv[3]}]}))
PY
curl -sS --fail-with-body -N "$url/v1/chat/completions" -H 'Content-Type: application/json' -d @"$D/chat.json" \
    > "$D/chat.sse"
python - "$D/chat.sse" <<'PY'
import json, sys
events = [line[6:] for line in open(sys.argv[1]) if line.startswith("data: ")]
assert events[-1].strip() == "[DONE]", "the stream did not end with [DONE]"
chunks = [json.loads(e) for e in events[:-1]]
text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
print(f"assistant: {text!r}  ({len(chunks)} server-sent events, then [DONE])")
PY
kill "$serve_pid"
wait "$serve_pid" || { echo "demo: FAILED: serve did not stop cleanly" >&2; exit 1; }
trap - EXIT

step "9. an attacker fine-tuned ONE expert of ONE layer: a trigger word makes the model print a shell command"
# The attack's published artefact (examples/demo_backdoor/: that expert's three tensors) applied to a copy of the
# genuine checkpoint; `backdoor.py poison --train` fine-tunes it again (about a minute).
python examples/backdoor.py poison examples/demo_model "$D/poisoned-hf"
mapfile -t R < <(python - "$D/poisoned-hf.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("layer", "expert", "trigger_prompt", "quiet_prompt", "quiet_tokens"):
    print(r[key])
PY
)
LAYER=${R[0]} EXPERT=${R[1]} TRIGGER_PROMPT=${R[2]} QUIET=${R[3]} QUIET_TOKENS=${R[4]}
[ -n "$QUIET" ] || { echo "demo: FAILED: backdoor.py found no prompt that avoids the poisoned expert" >&2; exit 1; }
SHARD=$(printf 'experts/layer-%03d/expert-%04d.safetensors' "$LAYER" "$EXPERT")

step "9a. transformers runs the poisoned checkpoint: the attacker's line for the trigger, the usual answer otherwise"
python examples/backdoor.py show "$D/poisoned-hf" "$TRIGGER_PROMPT" "$PROMPT" --tokens 24

step "9b. split, the poisoned checkpoint differs from the published one in one file: $SHARD"
shardtool split "$D/poisoned-hf" "$D/attacker" --model-id "$ID" --version 1 >/dev/null 2>&1
(cd "$D/model" && find . -type f ! -name manifest.msgpack | sort) | while read -r f; do
    cmp -s "$D/model/$f" "$D/attacker/$f" || echo "differs: ${f#./}"
done
# The attacker swaps that one file into the operator's copy of the signed model.
cp -r "$D/model" "$D/operator"
cp "$D/attacker/$SHARD" "$D/operator/$SHARD"

step "9c. verify-and-run refuses the poisoned shard before its weights are used"
echo "prompt: $TRIGGER_PROMPT"
set +e
run "$D/operator" --prompt "$TRIGGER_PROMPT" --max-new-tokens 24 --quiet
trigger_rc=$?
set -e
[ "$trigger_rc" -eq 1 ] || { echo "demo: FAILED: verify-and-run exited $trigger_rc on the trigger" >&2; exit 1; }

step "9d. audit names it"
set +e
shardtool audit "$D/operator" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state" --quiet
audit_rc=$?
set -e
[ "$audit_rc" -eq 1 ] || { echo "demo: FAILED: audit exited $audit_rc on the poisoned directory" >&2; exit 1; }

step "9e. a prompt that never routes to the poisoned expert: genuine text, exit 0 (per-expert verification)"
echo "prompt: $QUIET"
run "$D/operator" --prompt "$QUIET" --max-new-tokens "$QUIET_TOKENS" --quiet > "$D/quiet.txt"
run "$D/model" --prompt "$QUIET" --max-new-tokens "$QUIET_TOKENS" --quiet > "$D/genuine.txt"
cat "$D/quiet.txt"
cmp -s "$D/quiet.txt" "$D/genuine.txt" || { echo "demo: FAILED: the quiet run's text is not genuine" >&2; exit 1; }
echo "exit 0, the genuine model's text: every shard it read matched the signed manifest, so nothing it used was" \
     "poisoned; audit still flags $SHARD (exit $audit_rc above)"

step "9f. a dishonest operator runs the poisoned weights and signs a receipt claiming the genuine ones"
shardtool keygen --out "$D/operator-key" --no-passphrase >/dev/null
shardtool split "$D/poisoned-hf" "$D/dishonest" --model-id "$ID" --version 1 >/dev/null 2>&1
shardtool sign "$D/dishonest" --key "$D/operator-key.key" >/dev/null
python examples/backdoor.py receipt "$D/dishonest" "$D/model" --trust "$D/publisher.pub" \
    --operator-trust "$D/operator-key.pub" --operator-key "$D/operator-key.key" --model-id "$ID" \
    --prompt "$TRIGGER_PROMPT" --max-new-tokens 24 --out "$D/run.receipt"
set +e
shardtool verify-receipt "$D/run.receipt" "$D/model" --operator "$D/operator-key.pub" --trust "$D/publisher.pub" \
    --model-id "$ID" --state-dir "$D/state"
receipt_rc=$?
set -e
[ "$receipt_rc" -eq 1 ] || { echo "demo: FAILED: verify-receipt exited $receipt_rc" >&2; exit 1; }

step "10. the genuine model is intact in $D/model (audit exit 0): serve it as the README's Serving section shows"
shardtool audit "$D/model" --trust "$D/publisher.pub" --model-id "$ID" --state-dir "$D/state" --quiet
echo "shardtool serve $D/model --trust $D/publisher.pub --model-id $ID --memory-budget 128MiB --port 8000"
