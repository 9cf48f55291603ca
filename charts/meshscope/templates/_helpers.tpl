{{/*
Names and labels shared by every template (the usual name/fullname/labels/selectorLabels).
*/}}

{{- define "meshscope.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RELEASE-meshscope, or the release name alone when it already contains the chart's name. */}}
{{- define "meshscope.fullname" -}}
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

{{- define "meshscope.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshscope.labels" -}}
helm.sh/chart: {{ include "meshscope.chart" . }}
{{ include "meshscope.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: meshscope
{{- end }}

{{- define "meshscope.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshscope.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "meshscope.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "meshscope.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set it to an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The webhook Service (and the DNS names in its certificate), the certificate's Secret. */}}
{{- define "meshscope.webhookServiceName" -}}
{{- printf "%s-webhook" (include "meshscope.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshscope.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "meshscope.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshscope.certificateName" -}}
{{- printf "%s-webhook" (include "meshscope.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshscope.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "meshscope.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) }}
{{- end }}

{{/*
Where the webhook certificate is mounted in the operator's container: the files MESHSCOPE_OPERATOR_WEBHOOK_*_FILE
name (cert-manager's Secrets and kubernetes.io/tls Secrets both hold tls.crt, tls.key and ca.crt).
*/}}
{{- define "meshscope.certDir" -}}
/etc/meshscope/webhook
{{- end }}

{{/*
Both webhooks see only the watched namespaces when operator.namespaces is set: the operator's index holds only
their TrainingJobs, and a TrainingJob elsewhere would never be reconciled.
*/}}
{{- define "meshscope.webhookNamespaceSelector" -}}
{{- if .Values.operator.namespaces }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: In
      values:
        {{- toYaml .Values.operator.namespaces | nindent 8 }}
{{- end }}
{{- end }}

{{/*
RBAC, least privilege: every rule the operator needs and why (README.md, "Permissions", is this list as a table;
tests/chart checks the rendered rules against it). Namespaced rules go into one ClusterRole when every namespace is
watched, and into a Role in each watched namespace otherwise.
*/}}
{{- define "meshscope.rbac.namespacedRules" -}}
# kopf watches TrainingJobs (handlers and the index the pod webhook reads) and patches its progress
# annotations and finalizer (meshscope.io/...) onto them.
- apiGroups: [meshscope.io]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch]
# Reconcile and the cost tiers write the plan, the cost summary and conditions into status.
- apiGroups: [meshscope.io]
  resources: [trainingjobs/status]
  verbs: [patch]
# The Job, Service and ConfigMaps made for a TrainingJob name it as their owner with blockOwnerDeletion, which the
# OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) allows only to who may update its finalizers.
- apiGroups: [meshscope.io]
  resources: [trainingjobs/finalizers]
  verbs: [update]
# kopf posts Events for warnings and errors; reconcile posts one for each new finding.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Reconcile materialises a TrainingJob as an Indexed Job; on a conflict (409) it reads the existing one to compare.
# Watched: its status gives the TrainingJob's phase, and a deleted Job is made again. Never patched or deleted: the
# garbage collector removes it with its TrainingJob.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create]
# Its headless Service (stable DNS names for the pods: the master address; a drifted selector is patched), the
# placement ConfigMap the sidecars mount and the full cost table's ConfigMap (created, or patched where they exist).
# Watched: a deleted Service or placement ConfigMap is made again.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]
# The index of the job's pods: where they landed (the real placement) and the sidecars' addresses (the deep tier).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- if and .Values.operator.peering .Values.operator.namespaces }}
# kopf's peering, namespaced: which operator instance handles the TrainingJobs.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}

{{- define "meshscope.rbac.clusterRules" -}}
# kopf discovers the TrainingJob resource and notices when its CRD changes.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# Placement: the NVLink domain and network tiers of a pod's node are its labels, read node by node.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get]
{{- if .Values.operator.namespaces }}
# kopf watching named namespaces follows which of them exist.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- if and .Values.operator.peering (not .Values.operator.namespaces) }}
# kopf's peering, cluster-wide: which operator instance handles the TrainingJobs.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}
