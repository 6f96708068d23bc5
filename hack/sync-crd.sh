#!/usr/bin/env bash
# Copies the InferenceService CRD from crds/ (the one source of truth) into the Helm chart.
# Helm only installs CRDs from a chart's own crds/ folder, and a chart cannot read files
# outside itself, so the chart carries a copy; tests/charts/test_chart_crd_matches_source.py
# fails whenever the two differ. Run this after every change to crds/.
#
#   hack/sync-crd.sh           copy crds/ -> charts/tandem/crds/
#   hack/sync-crd.sh --check   exit 1 (and say so) when the copy is stale; copies nothing
set -euo pipefail

cd "$(dirname "$0")/.."
SRC=crds/inferenceservices.tandem.dev.yaml
DST=charts/tandem/crds/inferenceservices.tandem.dev.yaml

case ${1:-} in
  --check)
    if cmp -s "$SRC" "$DST"; then
      echo "sync-crd: $DST is up to date"
    else
      echo "sync-crd: $DST differs from $SRC; run hack/sync-crd.sh" >&2
      exit 1
    fi
    ;;
  "")
    mkdir -p "$(dirname "$DST")"
    cp "$SRC" "$DST"
    echo "sync-crd: copied $SRC -> $DST"
    ;;
  *)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
