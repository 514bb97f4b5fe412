# Sourced by the peer benchmarks (peer_bench.sh, peer_dflash2_bench.sh): $OUT made, and the peer's wheels
# (.peer/whl, from shared/peer-bench's get-wheels.sh) installed into $SITE, a folder of its own, so that our
# environment never sees speculators. $1: the caller's name, for the message when the wheels are missing.
OUT=${OUT:-/tmp/peer_out}
mkdir -p "$OUT"
if [ ! -d .peer/whl ]; then
  echo "$1: .peer/whl is missing (copy shared/peer-bench to .peer and run its get-wheels.sh whl)" >&2
  exit 2
fi
SITE=/tmp/peer_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .peer/whl/*.whl
