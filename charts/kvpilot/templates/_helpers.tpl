{{/* The release's full name, capped for label values. */}}
{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpilot
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Peering is needed as soon as two replicas could both work. */}}
{{- define "kvpilot.peering" -}}
{{- if or .Values.peering.enabled (gt (int .Values.replicaCount) 1) -}}true{{- end -}}
{{- end -}}

{{/* The rules for the InferenceServices and their children, in every watched namespace. */}}
{{- define "kvpilot.namespacedRules" -}}
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch, update]
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices/status]
  verbs: [get, patch, update]
# mode builtin: the pilot writes the replicas through the scale subresource
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices/scale]
  verbs: [get, patch, update]
# Children carry blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission plugin
# (on in OpenShift and hardened clusters) allows that only to who may update the owner's finalizers.
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [services, secrets, configmaps]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, update, patch, delete]
# The pilot lists a service's pods and scrapes them at their IPs (no pods/proxy), and keeps their
# pod-deletion-cost annotations current.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
# mode keda; engineMonitoring: the PodMonitors (only where those APIs are served)
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end -}}
