#!/usr/bin/env bash
# lm-eval-harness 0.4.13, unmodified, against `flashnext serve`: a loglikelihood task and a multiple-choice task
# read from the JSONL files beside this script (nothing is downloaded). lm-eval tokenizes with the served
# model's tokenizer and sends token ids with `echo: true, logprobs: 1, max_tokens: 1`, BATCH prompts per request.
#
#   pip install 'lm-eval[api]==0.4.13'       # once (into the environment that runs this script)
#   bash examples/lm_eval_local/run.sh       # serves the embedded tiny model on 127.0.0.1:$PORT
#   MODEL=path/to/checkpoint bash examples/lm_eval_local/run.sh   # a checkpoint (its tokenizer files beside it)
#
# Environment: PORT (8765), BATCH (4), LIMIT (rows per task; all), PYTHON (python), MODEL, TOKENIZER (default:
# MODEL, else the bundled tokenizer). Results go to examples/lm_eval_local/results/.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
PORT=${PORT:-8765}
BATCH=${BATCH:-4}
BUNDLED=$("$PYTHON" -c "import flashnext, os; print(os.path.join(os.path.dirname(flashnext.__file__), 'assets', 'tokenizer'))")
TOKENIZER=${TOKENIZER:-${MODEL:-$BUNDLED}}

"$PYTHON" -m flashnext serve --port "$PORT" ${MODEL:+--model "$MODEL"} > serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat serve.log; exit 1; }
  sleep 1
done
NAME=$(curl -sf "127.0.0.1:$PORT/v1/models" | "$PYTHON" -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")

HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$PYTHON" -m lm_eval \
  --model local-completions \
  --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$TOKENIZER,num_concurrent=1,max_retries=1" \
  --include_path . --tasks flashnext_last_word,flashnext_reverse_mc \
  --batch_size "$BATCH" ${LIMIT:+--limit "$LIMIT"} --output_path results
