#!/usr/bin/env bash
# Builds the real Kubernetes control plane used by the tests (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok, helm, and the LeaderWorkerSet
# controller) from Go modules at pinned versions: no prebuilt binary can be downloaded
# here, the Go module proxy can.
#
#   hack/k8s-bins.sh              build what is missing (seconds when all is there)
#   hack/k8s-bins.sh --print-dir  print the binaries dir; never builds
#
# Binaries land in ~/.cache/tandem/k8s/<version-key>/bin; Go's module and build
# caches live in ~/.cache/tandem/go so they persist across runs.
# KUBEBUILDER_ASSETS=<dir>: binaries found there are used as they are; only the
# missing ones are built, and --print-dir then prints a merged dir of links.
set -euo pipefail

K8S_VERSION=v1.37.2        # k8s.io/kubernetes; its staging modules are v0.37.2
ETCD_VERSION=v3.7.3        # go.etcd.io/etcd/server/v3 (k8s 1.37 builds against etcd 3.7)
KWOK_VERSION=v0.8.0        # sigs.k8s.io/kwok
HELM_VERSION=v3.22.0       # helm.sh/helm/v3
LWS_VERSION=v0.9.0         # sigs.k8s.io/lws: the LeaderWorkerSet controller, its CRD and webhooks (v0.10.0: the proxy refuses its zip, 403)
GO_PARALLEL=${TANDEM_GO_PARALLEL:-2}  # go build -p: 2 shared cores, kube-apiserver links are big
# Bump when the build recipe changes (flags, version variables): the cache key includes it, so
# binaries built by an older recipe are never reused. r2: version ldflags as the upstream Makefiles.
RECIPE=r2

# kwok-stages.yaml: KWOK's own default node/pod Stages (the kwok binary has none built
# in; kwokctl normally passes them), copied from the kwok module so that fake nodes
# become Ready and their pods Running.
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm kwok-stages.yaml)
KWOK_STAGE_FILES=(
  kustomize/stage/node/fast/node-initialize.yaml
  kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  kustomize/stage/pod/fast/pod-ready.yaml
  kustomize/stage/pod/fast/pod-complete.yaml
  kustomize/stage/pod/fast/pod-delete.yaml
)

CACHE_ROOT=${TANDEM_CACHE:-$HOME/.cache/tandem}
OS=$(uname -s | tr '[:upper:]' '[:lower:]')
ARCH=$(uname -m)
case $ARCH in x86_64) ARCH=amd64 ;; aarch64) ARCH=arm64 ;; esac
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_${OS}-${ARCH}_${RECIPE}"
KEY_DIR="$CACHE_ROOT/k8s/$KEY"
BIN_DIR="$KEY_DIR/bin"
# The LWS controller has its own key (a new LWS version must not rebuild Kubernetes); BIN_DIR
# holds links to it, so the tests still see one dir. lws-crds.yaml and lws-webhooks.yaml are
# copied from the module: the CRDs to install and the webhook configurations to point at it.
LWS_RECIPE=r2  # r2: every CRD the controller watches (LeaderWorkerSet and DisaggregatedSet)
LWS_DIR="$CACHE_ROOT/k8s/lws-${LWS_VERSION}_${OS}-${ARCH}_${LWS_RECIPE}/bin"
LWS_FILES=(lws-controller lws-crds.yaml lws-webhooks.yaml)
LWS_CRD_DIR=config/crd/bases  # the controller also runs a DisaggregatedSet controller: both CRDs
# The pod webhooks' objectSelector comes from these kustomize patches (kept as the module has them).
LWS_WEBHOOK_FILES=(config/webhook/manifests.yaml config/webhook/mutating-patch.yaml
  config/webhook/validating-patch.yaml)

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
}

# The dir the tests should use as KUBEBUILDER_ASSETS.
result_dir() {
  if [[ -n ${KUBEBUILDER_ASSETS:-} ]]; then
    local assets merged
    assets=$(cd "$KUBEBUILDER_ASSETS" && pwd)
    merged="$KEY_DIR/merged-$(printf '%s' "$assets" | sha256sum | cut -c1-12)"
    echo "$merged"
  else
    echo "$BIN_DIR"
  fi
}

# Links every binary into the merged dir: the user's own where it exists, ours otherwise.
make_merged() {
  local merged=$1 assets b
  assets=$(cd "$KUBEBUILDER_ASSETS" && pwd)
  mkdir -p "$merged"
  for b in "${BINARIES[@]}" "${LWS_FILES[@]}"; do
    if [[ -e "$assets/$b" ]]; then
      ln -sfn "$assets/$b" "$merged/$b"
    else
      ln -sfn "$BIN_DIR/$b" "$merged/$b"
    fi
  done
}

missing() {
  local b
  for b in "${BINARIES[@]}"; do
    if [[ -n ${KUBEBUILDER_ASSETS:-} && -e "$KUBEBUILDER_ASSETS/$b" ]]; then continue; fi
    [[ -e "$BIN_DIR/$b" ]] || echo "$b"
  done
  for b in "${LWS_FILES[@]}"; do
    if [[ -n ${KUBEBUILDER_ASSETS:-} && -e "$KUBEBUILDER_ASSETS/$b" ]]; then continue; fi
    [[ -e "$LWS_DIR/$b" ]] || echo "$b"
  done
}

# BIN_DIR's links to the LWS files of the pinned version (relinked when the version changes).
link_lws() {
  local b
  for b in "${LWS_FILES[@]}"; do
    if [[ -e "$LWS_DIR/$b" && "$(readlink "$BIN_DIR/$b" 2>/dev/null)" != "$LWS_DIR/$b" ]]; then
      mkdir -p "$BIN_DIR"
      ln -sfn "$LWS_DIR/$b" "$BIN_DIR/$b"
    fi
  done
}

need_go() {
  if ! command -v go >/dev/null 2>&1; then
    cat >&2 <<EOF
hack/k8s-bins.sh: 'go' is not on PATH, and these binaries must be built: $*
Install Go >= 1.26 (https://go.dev/doc/install, or your distribution's golang
package), or point KUBEBUILDER_ASSETS at a dir that already holds
${BINARIES[*]}.
EOF
    exit 2
  fi
}

log() { echo "k8s-bins: $*" >&2; }

write_kwok_stages() {
  local dir f
  dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  log "writing kwok-stages.yaml from sigs.k8s.io/kwok@$KWOK_VERSION"
  for f in "${KWOK_STAGE_FILES[@]}"; do
    cat "$dir/$f"
    echo "---"
  done >"$STAGE/kwok-stages.yaml"
}

# go.mod path of a module version, downloading it into the module cache if needed.
gomod_of() {
  go mod download -json "$1" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p'
}

build_kubernetes() {
  local want=("$@") src kmod staging pkgs=() b minor ver_flags
  src="$CACHE_ROOT/go/wrappers/kubernetes-$K8S_VERSION"
  mkdir -p "$src"
  kmod=$(gomod_of "k8s.io/kubernetes@$K8S_VERSION")
  # Every staging module kubernetes replaces with ./staging/src/k8s.io/<name>.
  staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/.*#\1#p' "$kmod")
  [[ -n $staging ]] || { log "no staging modules found in $kmod"; exit 1; }
  minor=${K8S_VERSION#v1.}
  {
    echo "// Generated by hack/k8s-bins.sh: builds k8s.io/kubernetes commands from the module proxy."
    echo "module tandem.local/kubernetes-bins"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m v0.$minor"; done
    echo ")"
  } >"$src/go.mod.new"
  if ! cmp -s "$src/go.mod.new" "$src/go.mod.gen"; then
    cp "$src/go.mod.new" "$src/go.mod"
    cp "$src/go.mod.new" "$src/go.mod.gen"
    rm -f "$src/go.sum"
  fi
  rm -f "$src/go.mod.new"
  for b in "${want[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  local major=1 kminor=${minor%%.*}
  ver_flags=""
  # As kubernetes' hack/lib/version.sh does. The module proxy serves no git metadata, so the
  # commit is left empty (unknown) rather than the "$Format:%H$" placeholder compiled in.
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ver_flags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$kminor"
    ver_flags+=" -X $p.gitCommit= -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "building ${want[*]} from k8s.io/kubernetes@$K8S_VERSION"
  (cd "$src" && go build -mod=mod -p "$GO_PARALLEL" -trimpath -ldflags="-s -w$ver_flags" \
    -o "$STAGE/" "${pkgs[@]}")
}

build_etcd() {
  local src="$CACHE_ROOT/go/wrappers/etcd-$ETCD_VERSION"
  mkdir -p "$src"
  cat >"$src/main.go" <<'EOF'
// Generated by hack/k8s-bins.sh: the etcd server, built from go.etcd.io/etcd/server/v3.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
  if [[ ! -f "$src/go.sum" ]]; then
    printf 'module tandem.local/etcd-bin\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
      "$ETCD_VERSION" >"$src/go.mod"
    (cd "$src" && go mod tidy)
  fi
  log "building etcd from go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  (cd "$src" && go build -p "$GO_PARALLEL" -trimpath -ldflags='-s -w' -o "$STAGE/etcd" .)
}

# A module's own command, built through a wrapper module that requires it (so the
# module's go.sum-verified dependency versions are the ones used).
build_module_cmd() {
  local name=$1 module=$2 version=$3 pkg=$4 extra_ldflags=${5:-}
  local src="$CACHE_ROOT/go/wrappers/$name-$version"
  mkdir -p "$src"
  if [[ ! -f "$src/go.mod" ]]; then
    printf 'module tandem.local/%s-bin\n\ngo 1.26.0\n\nrequire %s %s\n' "$name" "$module" "$version" >"$src/go.mod"
  fi
  log "building $name from $module@$version"
  (cd "$src" && go build -mod=mod -p "$GO_PARALLEL" -trimpath -ldflags="-s -w$extra_ldflags" \
    -o "$STAGE/$name" "$pkg")
}

# The LWS controller (its Makefile's version ldflags; the commit is the tag's, which the module
# proxy's .info names), its CRD and its webhook configurations, from sigs.k8s.io/lws.
build_lws() {
  local dir f flags p=sigs.k8s.io/lws/pkg/version
  dir=$(go mod download -json "sigs.k8s.io/lws@$LWS_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  mkdir -p "$LWS_DIR"
  log "writing lws-crds.yaml and lws-webhooks.yaml from sigs.k8s.io/lws@$LWS_VERSION"
  for f in "$dir/$LWS_CRD_DIR"/*.yaml; do
    cat "$f"
    echo "---"
  done >"$STAGE/lws-crds.yaml"
  for f in "${LWS_WEBHOOK_FILES[@]}"; do
    echo "# $f"
    cat "$dir/$f"
    echo
    echo "---"
  done >"$STAGE/lws-webhooks.yaml"
  flags=" -X $p.GitVersion=$LWS_VERSION -X $p.BuildDate=1970-01-01T00:00:00Z -X $p.GitCommit="
  build_module_cmd lws-controller sigs.k8s.io/lws "$LWS_VERSION" sigs.k8s.io/lws/cmd "$flags"
  for f in "${LWS_FILES[@]}"; do mv -f "$STAGE/$f" "$LWS_DIR/$f"; done
}

# helm's Makefile: its version, and the Kubernetes version `helm template` and `helm lint` assume
# without a cluster (from the client-go helm builds against; unset, helm assumes v1.20).
helm_ldflags() {
  local mod kver major minor p flags
  mod=$(gomod_of "helm.sh/helm/v3@$HELM_VERSION")
  kver=$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$mod" | head -1)
  [[ -n $kver ]] || { log "no k8s.io/client-go version in $mod"; exit 1; }
  major=1 minor=$kver
  flags=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  flags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    flags+=" -X $p.k8sVersionMajor=$major -X $p.k8sVersionMinor=$minor"
  done
  echo "$flags"
}

main() {
  local print_dir=0
  case ${1:-} in
    --print-dir) print_dir=1 ;;
    -h | --help) usage; exit 0 ;;
    "") ;;
    *) usage >&2; exit 2 ;;
  esac
  if [[ -n ${KUBEBUILDER_ASSETS:-} && ! -d $KUBEBUILDER_ASSETS ]]; then
    log "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS is not a directory"
    exit 2
  fi
  if ((print_dir)); then
    result_dir
    return
  fi

  link_lws
  mapfile -t todo < <(missing)
  if ((${#todo[@]} == 0)); then
    [[ -z ${KUBEBUILDER_ASSETS:-} ]] || make_merged "$(result_dir)"
    log "all binaries present in $(result_dir)"
    return
  fi
  need_go "${todo[@]}"
  export GOMODCACHE="$CACHE_ROOT/go/mod" GOCACHE="$CACHE_ROOT/go/build"
  export GOFLAGS="-modcacherw" GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0
  export GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}
  mkdir -p "$BIN_DIR" "$GOMODCACHE" "$GOCACHE"
  STAGE=$(mktemp -d "$KEY_DIR/stage.XXXXXX")
  trap 'rm -rf "$STAGE"' EXIT

  local kube=() b lws=0
  for b in "${todo[@]}"; do
    case $b in
      kube-apiserver | kube-controller-manager | kube-scheduler | kubectl) kube+=("$b") ;;
      lws-*) lws=1 ;;
    esac
  done
  # Each result is moved into place as soon as it is built, so a failure later keeps it.
  for b in "${todo[@]}"; do
    case $b in
      etcd) build_etcd ;;
      kwok-stages.yaml) write_kwok_stages ;;
      kwok) build_module_cmd kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok \
        " -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" ;;
      helm) build_module_cmd helm helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm \
        "$(helm_ldflags)" ;;
      *) continue ;;
    esac
    mv -f "$STAGE/$b" "$BIN_DIR/$b"
  done
  if ((lws)); then
    build_lws
    link_lws
  fi
  if ((${#kube[@]} > 0)); then
    build_kubernetes "${kube[@]}"
    for b in "${kube[@]}"; do mv -f "$STAGE/$b" "$BIN_DIR/$b"; done
  fi
  [[ -z ${KUBEBUILDER_ASSETS:-} ]] || make_merged "$(result_dir)"
  log "built ${todo[*]} into $BIN_DIR"
}

main "$@"
