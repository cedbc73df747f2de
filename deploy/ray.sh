#!/usr/bin/env bash
# moe-fabric on a Ray cluster of three machines: run this on each, with its role.
#   deploy/ray.sh head   10.0.0.1            # machine A: the Ray head, then the fabric
#   deploy/ray.sh worker 10.0.0.2 10.0.0.1   # machines B and C: join A's Ray cluster
# Needs on every machine: pip install 'moe-fabric[ray]', the model at $MODEL, and (head only) the
# cluster secret at $SECRET (created here if missing; it reaches the other machines sealed).
set -euo pipefail
role="${1:?head or worker}"; self="${2:?this machine's address}"; head="${3:-$self}"
MODEL="${MODEL:-/srv/models/m}"; SECRET="${SECRET:-/etc/moe-fabric/secret}"
# A dead node is declared dead in ~1.5 s instead of Ray's default ~15 s.
CHECKS='{"health_check_period_ms": 500, "health_check_failure_threshold": 3}'
if [ "$role" = head ]; then
  ray start --head --node-ip-address "$self" --port 6379 --system-config "$CHECKS"
  echo "start the workers now (deploy/ray.sh worker <their address> $self), then press Enter"; read -r
  [ -f "$SECRET" ] || moe-fabric cluster-secret "$SECRET"
  exec moe-fabric serve --cluster ray --ray-address "$self:6379" --model "$MODEL" --transport tcp \
    --attention-workers 3 --expert-workers 3 --checkpoint-stores 1 --gateways 2 \
    --aw-resources '{"GPU": 1}' --ew-resources '{"GPU": 1}' \
    --cluster-secret-file "$SECRET" --port 8000
else
  exec ray start --address "$head:6379" --node-ip-address "$self" --block
fi
