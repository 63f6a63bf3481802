{{/* Names, labels and the small computations every template shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix, at most 45 characters so "<fullname>-engine-headless" (+17) still fits the
63-character DNS label limit of a Service name.
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Full labels of one component; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.engine.fullname" -}}
{{- printf "%s-engine" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.engine.headlessName" -}}
{{- printf "%s-engine-headless" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.frontend.fullname" -}}
{{- printf "%s-frontend" (include "tandem.fullname" .) }}
{{- end }}

{{/* FQDN of the engine headless Service: one DNS A record per ready engine pod. */}}
{{- define "tandem.engine.headlessFqdn" -}}
{{- printf "%s.%s.svc.cluster.local" (include "tandem.engine.headlessName" .) .Release.Namespace }}
{{- end }}

{{/* What the gateway's --engine points at: every engine pod, re-resolved through DNS. */}}
{{- define "tandem.frontend.engineTarget" -}}
{{- if .Values.frontend.engineTarget }}
{{- .Values.frontend.engineTarget }}
{{- else }}
{{- printf "dns:///%s:%d" (include "tandem.engine.headlessFqdn" .) (int .Values.engine.port) }}
{{- end }}
{{- end }}

{{- define "tandem.tls.serverName" -}}
{{- default (include "tandem.engine.headlessFqdn" .) .Values.tls.serverName }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the gateway API key, or "" when the API is open. */}}
{{- define "tandem.apiKey.secretName" -}}
{{- if .Values.frontend.apiKey.existingSecret }}
{{- .Values.frontend.apiKey.existingSecret }}
{{- else if .Values.frontend.apiKey.value }}
{{- printf "%s-api-key" (include "tandem.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tandem.engine.image" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) }}
{{- end }}

{{- define "tandem.frontend.image" -}}
{{- printf "%s:%s" .Values.frontend.image.repository (default .Chart.AppVersion .Values.frontend.image.tag) }}
{{- end }}

{{/* The port the kubelet's gRPC probes use: the plaintext health port whenever TLS is on. */}}
{{- define "tandem.engine.probePort" -}}
{{- if .Values.tls.enabled }}{{ .Values.engine.healthPort }}{{ else }}{{ .Values.engine.port }}{{ end }}
{{- end }}

{{/* terminationGracePeriodSeconds of an engine pod: drain time plus margin. */}}
{{- define "tandem.engine.terminationGracePeriodSeconds" -}}
{{- add (ceil .Values.engine.shutdownTimeout | int) .Values.engine.terminationGracePeriodMarginSeconds }}
{{- end }}

{{/* Fail early on values the schema cannot express across sections. */}}
{{- define "tandem.validate" -}}
{{- $src := .Values.engine.model.source }}
{{- if and (eq $src "existingClaim") (not .Values.engine.model.existingClaim) }}
{{- fail "engine.model.source=existingClaim needs engine.model.existingClaim" }}
{{- end }}
{{- if and (eq $src "hostPath") (not .Values.engine.model.hostPath.path) }}
{{- fail "engine.model.source=hostPath needs engine.model.hostPath.path" }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.engineSecret }}
{{- fail "tls.enabled needs tls.engineSecret (a kubernetes.io/tls Secret with ca.crt)" }}
{{- end }}
{{- if not .Values.tls.frontendSecret }}
{{- fail "tls.enabled needs tls.frontendSecret (a kubernetes.io/tls Secret with ca.crt)" }}
{{- end }}
{{- if eq (int .Values.engine.healthPort) (int .Values.engine.port) }}
{{- fail "engine.healthPort must differ from engine.port" }}
{{- end }}
{{- end }}
{{- if and .Values.frontend.podDisruptionBudget.enabled (not (kindIs "invalid" .Values.frontend.podDisruptionBudget.minAvailable)) (not (kindIs "invalid" .Values.frontend.podDisruptionBudget.maxUnavailable)) }}
{{- fail "frontend.podDisruptionBudget: set only one of minAvailable / maxUnavailable" }}
{{- end }}
{{- end }}
