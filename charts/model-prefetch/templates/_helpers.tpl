{{/*
Names. With the release called "model-prefetch" (the README's install command) every object gets
the same name as in daemonset/ (tests/test_helm_chart.py compares the two).
*/}}
{{- define "model-prefetch.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "model-prefetch.agentName" -}}
{{- printf "%s-agent" (include "model-prefetch.fullname" .) -}}
{{- end -}}

{{/*
Objects outside the release's namespace (the ClusterRole and its binding, the events Role and
RoleBinding in "default") are shared by every release: their names carry the release's
namespace, so two releases of one name in two namespaces do not take each other's. The chart's
default namespace, model-prefetch, is left out: those names stay daemonset/'s.
*/}}
{{- define "model-prefetch.clusterWideName" -}}
{{- $agent := include "model-prefetch.agentName" . -}}
{{- if eq .Release.Namespace "model-prefetch" -}}
{{- $agent -}}
{{- else -}}
{{- printf "%s-%s" $agent .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "model-prefetch.configMapName" -}}
{{- printf "%s-config" (include "model-prefetch.fullname" .) -}}
{{- end -}}

{{- define "model-prefetch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "model-prefetch.agentName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: set it when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "model-prefetch.credentialsSecretName" -}}
{{- default (printf "%s-credentials" (include "model-prefetch.fullname" .)) .Values.credentials.secretName -}}
{{- end -}}

{{- define "model-prefetch.mirrorServiceAccountName" -}}
{{- if .Values.mirror.serviceAccount.create -}}
{{- default (printf "%s-mirror" (include "model-prefetch.fullname" .)) .Values.mirror.serviceAccount.name -}}
{{- else -}}
{{- required "mirror.serviceAccount.name: set it when mirror.serviceAccount.create is false" .Values.mirror.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image reference: a digest, when set, wins over the tag. */}}
{{- define "model-prefetch.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Selector labels (immutable on a DaemonSet: never add to them in an upgrade). */}}
{{- define "model-prefetch.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels every object carries; "component" is added per object. */}}
{{- define "model-prefetch.labels" -}}
{{ include "model-prefetch.selectorLabels" . }}
app.kubernetes.io/part-of: model-prefetch
app.kubernetes.io/version: {{ (default .Chart.AppVersion .Values.image.tag) | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "model-prefetch.agentLabels" -}}
{{ include "model-prefetch.labels" . }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "model-prefetch.agentSelectorLabels" -}}
{{ include "model-prefetch.selectorLabels" . }}
app.kubernetes.io/component: agent
{{- end -}}

{{/* The agent's HTTP port: from config.listen (host:port), else the agent's default 8090. */}}
{{- define "model-prefetch.port" -}}
{{- $listen := default "0.0.0.0:8090" .Values.config.listen -}}
{{- last (splitList ":" $listen) -}}
{{- end -}}
