{{/* Names and labels shared by every template. */}}

{{- define "tensile.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tensile.fullname" -}}
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

{{- define "tensile.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tensile.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include "tensile.selectorLabels" (list . "operator") */}}
{{- define "tensile.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "tensile.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "tensile.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tensile.operatorName" -}}
{{ include "tensile.fullname" . | trunc 54 | trimSuffix "-" }}-operator
{{- end }}

{{- define "tensile.agentName" -}}
{{ include "tensile.fullname" . | trunc 57 | trimSuffix "-" }}-agent
{{- end }}

{{- define "tensile.webhookName" -}}
{{ include "tensile.fullname" . | trunc 55 | trimSuffix "-" }}-webhook
{{- end }}

{{- define "tensile.tokenSecretName" -}}
{{ .Values.tokenKey.existingSecret | default (printf "%s-token-key" (include "tensile.fullname" . | trunc 53 | trimSuffix "-")) }}
{{- end }}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "tensile.webhookCertSecret" -}}
{{ include "tensile.webhookName" . }}-tls
{{- end }}

{{/* Restricted pod security: non-root, no privilege escalation, no capabilities. */}}
{{- define "tensile.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "tensile.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
