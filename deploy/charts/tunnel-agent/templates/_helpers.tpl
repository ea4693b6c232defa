{{/* The objects' name: <release>-<chart>, or the release's name if it contains the chart's. */}}
{{- define "tunnel-agent.fullname" -}}
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

{{- define "tunnel-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tunnel-agent.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "tunnel-agent.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: immutable in a Deployment, so only these two. */}}
{{- define "tunnel-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tunnel-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tunnel-agent.labels" -}}
helm.sh/chart: {{ include "tunnel-agent.chart" . }}
{{ include "tunnel-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ include "tunnel-agent.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kcp-tunnel-broker
app.kubernetes.io/component: agent
{{- with .Values.extraLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata: name, namespace, labels and annotations of a namespaced object; pass (list . "suffix"). */}}
{{- define "tunnel-agent.metadata" -}}
{{- $ := index . 0 }}
{{- $suffix := index . 1 -}}
name: {{ include "tunnel-agent.fullname" $ }}{{ $suffix }}
namespace: {{ include "tunnel-agent.namespace" $ }}
labels:
  {{- include "tunnel-agent.labels" $ | nindent 2 }}
{{- with $.Values.extraAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tunnel-agent.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tunnel-agent.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (include "tunnel-agent.tag" .) }}
{{- end }}
{{- end }}

{{- define "tunnel-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tunnel-agent.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Where Prometheus scrapes: the metrics port of the values. */}}
{{- define "tunnel-agent.prometheusAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | toString | quote }}
prometheus.io/path: /metrics
{{- end }}

{{- define "tunnel-agent.imagePullSecrets" -}}
{{- range .Values.global.imagePullSecrets }}
{{- if kindIs "map" . }}
- {{ toYaml . | trim }}
{{- else }}
- name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tunnel-agent.svidSource" -}}
{{- $s := .Values.svid.source }}
{{- if not (has $s (list "spire" "secret")) }}
{{- fail (printf "svid.source is %q: it is spire or secret" $s) }}
{{- end }}
{{- if and (eq $s "secret") (not .Values.svid.secret.name) }}
{{- fail "svid.source is secret: set svid.secret.name, a Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- $s }}
{{- end }}

{{/*
tunnel-agent.shutdown checks that the pod's terminationGracePeriodSeconds
covers the tunnels' --grace and a margin of 5 s: the kubelet kills the pod
at its end, cutting off tunnels that --grace promised to let finish. grace
is whole seconds or minutes (20s, 2m).
*/}}
{{- define "tunnel-agent.shutdown" -}}
{{- $g := toString .Values.grace }}
{{- $grace := 0 }}
{{- if regexMatch "^[0-9]+s$" $g }}
{{- $grace = trimSuffix "s" $g | int }}
{{- else if regexMatch "^[0-9]+m$" $g }}
{{- $grace = mul (trimSuffix "m" $g | int) 60 }}
{{- else }}
{{- fail (printf "grace is %q: whole seconds or minutes, like 20s or 2m" $g) }}
{{- end }}
{{- $pre := 0 }}
{{- $need := add $pre $grace 5 }}
{{- if lt (int .Values.terminationGracePeriodSeconds) $need }}
{{- fail (printf "terminationGracePeriodSeconds is %d: it must be at least %d, grace (%d s) plus 5 s, or the kubelet kills tunnels that --grace lets run" (int .Values.terminationGracePeriodSeconds) $need $grace) }}
{{- end }}
{{- end }}
