#!/usr/bin/env bash
# End-to-end serving comparison on a GPU machine: time to first token of long
# prompts that come back after the GPU cache and the CPU tier have forgotten
# them, with vLLM's CPU tier alone, with vLLM's `fs` tier and with kvtier's
# disk tier below it, and with KvTierConnector (kvtier's workflow policy on the
# CPU tier, no disk tier) with round 1's prompts hinted as sessions pinned for
# 10 minutes (`kv_transfer_params: {"kvtier": {"session_id": ..., "cache_ttl_s":
# 600}}`; the churn is not hinted). Each configuration serves the same rounds:
#   1. cold: N distinct long prompts (computed, offloaded);
#   2. churn: enough other prompts to push round 1 out of the GPU and CPU tiers;
#   3. warm: round 1 again (served from the disk tier if there is one);
#   4. restart: the server is restarted and round 1 sent once more.
# It needs a GPU, vLLM 0.33 and kvtier installed; it prints one line per
# configuration and round and writes bench/results/vllm_serve_tiers.json.
#
#   MODEL=Qwen/Qwen3-8B bash bench/vllm_serve_tiers.sh
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
PORT=${PORT:-8011}
CPU_BYTES=${CPU_BYTES:-4294967296}
DISK_DIR=${DISK_DIR:-/tmp/kvtier-serve-bench}
PROMPTS=${PROMPTS:-32}
PROMPT_TOKENS=${PROMPT_TOKENS:-8000}
CHURN=${CHURN:-256}
OUT=${OUT:-bench/results/vllm_serve_tiers.json}

config() {  # $1: none | fs | kvtier | kvtier-hints
  local tiers="[]"
  if [ "$1" = kvtier-hints ]; then
    cat <<EOF
{"kv_connector": "KvTierConnector", "kv_role": "kv_both",
 "kv_connector_module_path": "kvtier.integrations.vllm.connector",
 "kv_connector_extra_config": {"cpu_bytes_to_use": $CPU_BYTES, "kvtier_policy": "workflow"}}
EOF
    return
  fi
  case $1 in
    fs) tiers="[{\"type\": \"fs\", \"root_dir\": \"$DISK_DIR/fs\"}]" ;;
    kvtier) tiers="[{\"type\": \"KvTierSecondaryTier\",
      \"module_path\": \"kvtier.integrations.vllm.tiering\",
      \"url\": \"disk:$DISK_DIR/kvtier?size=200GiB&policy=s3fifo\"}]" ;;
  esac
  cat <<EOF
{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
 "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
   "cpu_bytes_to_use": $CPU_BYTES, "secondary_tiers": $tiers}}
EOF
}

start_server() {
  vllm serve "$MODEL" --port "$PORT" --kv-transfer-config "$(config "$1")" \
    >"$DISK_DIR/server-$1.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf "localhost:$PORT/v1/models" >/dev/null && return 0
    sleep 1
  done
  echo "server did not start; see $DISK_DIR/server-$1.log" >&2
  exit 1
}

stop_server() { kill "$SERVER"; wait "$SERVER" || true; }

round() {  # $1 config, $2 round name, $3 first prompt seed, $4 count, $5 hint (0/1)
  python - "$1" "$2" "$3" "$4" "${5:-0}" <<'EOF'
import json, os, random, sys, time
import urllib.request
cfg, name, seed, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
hinted = sys.argv[5] == "1"
port, model = os.environ["PORT"], os.environ["MODEL"]
words = int(os.environ["PROMPT_TOKENS"]) * 3 // 4
ttfts = []
for i in range(seed, seed + count):
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(words))
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
    if hinted:
        body["kv_transfer_params"] = {"kvtier": {"session_id": f"s{i}", "cache_ttl_s": 600}}
    body = json.dumps(body).encode()
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req) as resp:
        resp.readline()
        ttfts.append(time.perf_counter() - start)
        resp.read()
ttfts.sort()
line = {"config": cfg, "round": name, "prompts": count,
        "ttft_median_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)]}
print(json.dumps(line))
with open(os.environ["OUT"], "a") as fh:
    fh.write(json.dumps(line) + "\n")
EOF
}

export PORT MODEL PROMPT_TOKENS OUT
mkdir -p "$DISK_DIR" "$(dirname "$OUT")"
: >"$OUT"
for cfg in none fs kvtier kvtier-hints; do
  rm -rf "${DISK_DIR:?}/fs" "${DISK_DIR:?}/kvtier"
  hint=0
  [ "$cfg" = kvtier-hints ] && hint=1
  start_server "$cfg"
  round "$cfg" cold 0 "$PROMPTS" "$hint"
  round "$cfg" churn 100000 "$CHURN"
  round "$cfg" warm 0 "$PROMPTS" "$hint"
  stop_server
  start_server "$cfg"
  round "$cfg" restart 0 "$PROMPTS" "$hint"
  stop_server
done
