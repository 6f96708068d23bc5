{{/* Names and labels shared by every template. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Objects of the operator itself: Deployment, Service, ServiceAccount. */}}
{{- define "tandem.operatorName" -}}
{{- printf "%s-operator" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Cluster-scoped objects are shared by every namespace: the release namespace keeps two
installs of the same release name apart. */}}
{{- define "tandem.clusterName" -}}
{{- printf "%s-%s" (include "tandem.operatorName" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "tandem.workerImage" -}}
{{- printf "%s:%s" .Values.workerDefaults.image.repository (default .Chart.AppVersion .Values.workerDefaults.image.tag) }}
{{- end }}

{{- define "tandem.vllmImage" -}}
{{- printf "%s:%s" .Values.vllmDefaults.image.repository (default .Chart.AppVersion .Values.vllmDefaults.image.tag) }}
{{- end }}

{{- define "tandem.routerImage" -}}
{{- printf "%s:%s" .Values.routerDefaults.image.repository (default .Chart.AppVersion .Values.routerDefaults.image.tag) }}
{{- end }}

{{/* The Restricted pod security level, for the operator pod and the `helm test` pod. */}}
{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "tandem.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Exactly what the operator calls in the namespaces it serves (operator/api_client.py, watch.py;
docs/install.md lists each call). A ClusterRole when it serves every namespace, a Role in
each watched namespace otherwise. The end-to-end test runs the operator with a token of this
ServiceAccount, so a rule missing here fails it. No delete anywhere: children go with their
InferenceService through owner references and the garbage collector.
*/}}
{{- define "tandem.operatorRules" -}}
# The InferenceService: kopf lists and watches it (event and index handlers only: kopf writes
# nothing on it); a pass reads it when the watch may lag its own status write; status goes through
# the subresource.
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
# Children, written with server-side apply. An apply is a PATCH, and the API server also checks
# `create` when that PATCH creates the object. Every kind the operator applies is listed and
# watched (selected by its labels on the API server): a pass observes the children from those
# watches instead of listing them, and a child deleted or edited by hand is corrected from its
# event. `get` reads a child the watch cannot vouch for before applying over it. A worker role
# whose tensor-parallel group spans nodes is a LeaderWorkerSet instead (sigs.k8s.io/lws);
# `delete` only when a role changes between the two kinds (the old workload goes).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Each component's PodDisruptionBudget, server-side applied like the other children.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# spec.gateway: the InferencePool of the decode pods and an HTTPRoute to it. Their CRDs come with
# the user's gateway (Gateway API Inference Extension); without them kopf does not watch these.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch"]
# A hub model's shared cache (model.cache.pvc): its claim and the download Job per commit (watched:
# ModelReady follows it); a model.pvc claim is read (get) to check it exists and mounts on every node.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- with .Values.hub.tokenSecrets }}
# model.tokenSecretRef: the hub token of a gated model, read to resolve its revision and read its
# config.json; only these names.
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: {{ toJson . }}
  verbs: ["get"]
{{- end }}
# Each service's internal secret (router <-> workers) is created once, if absent. Create only:
# the operator never reads, lists or changes a Secret.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Pods: readiness and scheduling failures become status conditions. The router's Role grants
# pods and EndpointSlices get/list/watch, and Kubernetes lets the operator write (and bind) a
# Role only with every permission it grants (no `escalate` or `bind` verbs here), so the
# operator holds them too. Never create, change or delete: the ReplicaSet does that (marking
# the pods a scale-down removes is tandem.podMarkerRules, only where autoscaling.markPodsForRemoval
# names a namespace).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# The pods' owner chain: ReplicaSets are watched (the operator's own, by label), a group's
# StatefulSets read once each; the router's Role also grants replicasets/deployments/statefulsets/
# leaderworkersets get (its discovery follows a pod's owners up to the InferenceService).
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get"]
# Events on the InferenceService for what the operator did (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* What kopf needs at cluster scope whatever it serves: it lists and watches CRDs to
notice resources that appear or change; when it serves a list of namespaces it also lists
and watches namespaces to notice them appear. */}}
{{- define "tandem.frameworkRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* autoscaling.markPodsForRemoval: before it lowers a worker role's replicas, the planner gives
the pods it chose the lowest controller.kubernetes.io/pod-deletion-cost, so the ReplicaSet removes
exactly those. A patch of pods: RBAC cannot narrow it to annotations, so a Role per named namespace,
never cluster-wide. */}}
{{- define "tandem.podMarkerRules" -}}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["patch"]
{{- end }}

{{/* The namespaces where the operator may mark pods (autoscaling.markPodsForRemoval). */}}
{{- define "tandem.podMarkerNamespaces" -}}
{{- $mark := .Values.autoscaling.markPodsForRemoval }}
{{- $namespaces := $mark.namespaces | default .Values.watchNamespaces }}
{{- if not $namespaces }}
{{- fail "autoscaling.markPodsForRemoval.namespaces: name the namespaces where the operator may annotate pods (or set watchNamespaces): pods: patch is never granted cluster-wide" }}
{{- end }}
{{- toJson $namespaces }}
{{- end }}

{{/* Leader election, in the operator's own namespace: read and renew its Lease (by name), and
create it the first time (RBAC cannot name an object that does not exist yet). */}}
{{- define "tandem.leaseRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "update"]
  resourceNames: [{{ include "tandem.operatorName" . | quote }}]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
{{- end }}
