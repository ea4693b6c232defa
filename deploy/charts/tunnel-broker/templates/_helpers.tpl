{{/* The objects' name: <release>-<chart>, or the release's name if it contains the chart's. */}}
{{- define "tunnel-broker.fullname" -}}
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

{{- define "tunnel-broker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tunnel-broker.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "tunnel-broker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: immutable in a Deployment, so only these two. */}}
{{- define "tunnel-broker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tunnel-broker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tunnel-broker.labels" -}}
helm.sh/chart: {{ include "tunnel-broker.chart" . }}
{{ include "tunnel-broker.selectorLabels" . }}
app.kubernetes.io/version: {{ include "tunnel-broker.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kcp-tunnel-broker
app.kubernetes.io/component: broker
{{- with .Values.extraLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata: name, namespace, labels and annotations of a namespaced object; pass (list . "suffix"). */}}
{{- define "tunnel-broker.metadata" -}}
{{- $ := index . 0 }}
{{- $suffix := index . 1 -}}
name: {{ include "tunnel-broker.fullname" $ }}{{ $suffix }}
namespace: {{ include "tunnel-broker.namespace" $ }}
labels:
  {{- include "tunnel-broker.labels" $ | nindent 2 }}
{{- with $.Values.extraAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tunnel-broker.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tunnel-broker.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (include "tunnel-broker.tag" .) }}
{{- end }}
{{- end }}

{{- define "tunnel-broker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tunnel-broker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The policy file's text: policy is a map, or the file's text (--set-file). */}}
{{- define "tunnel-broker.policy" -}}
{{- if not .Values.policy }}
{{- fail "policy is required: the broker does not start without one (values.yaml shows an example)" }}
{{- else if kindIs "string" .Values.policy }}
{{- .Values.policy }}
{{- else }}
{{- toYaml .Values.policy }}
{{- end }}
{{- end }}

{{/* Where Prometheus scrapes: the metrics port of the values. */}}
{{- define "tunnel-broker.prometheusAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | toString | quote }}
prometheus.io/path: /metrics
{{- end }}

{{- define "tunnel-broker.imagePullSecrets" -}}
{{- range .Values.global.imagePullSecrets }}
{{- if kindIs "map" . }}
- {{ toYaml . | trim }}
{{- else }}
- name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tunnel-broker.svidSource" -}}
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
tunnel-broker.shutdown checks that the pod's terminationGracePeriodSeconds
covers the preStop sleep, the tunnels' --grace and a margin of 5 s: the
kubelet kills the pod at its end, cutting off tunnels that --grace promised
to let finish. grace is whole seconds or minutes (20s, 2m).
*/}}
{{- define "tunnel-broker.shutdown" -}}
{{- $g := toString .Values.grace }}
{{- $grace := 0 }}
{{- if regexMatch "^[0-9]+s$" $g }}
{{- $grace = trimSuffix "s" $g | int }}
{{- else if regexMatch "^[0-9]+m$" $g }}
{{- $grace = mul (trimSuffix "m" $g | int) 60 }}
{{- else }}
{{- fail (printf "grace is %q: whole seconds or minutes, like 20s or 2m" $g) }}
{{- end }}
{{- $pre := (int .Values.preStopSleepSeconds) }}
{{- $need := add $pre $grace 5 }}
{{- if lt (int .Values.terminationGracePeriodSeconds) $need }}
{{- fail (printf "terminationGracePeriodSeconds is %d: it must be at least %d, the preStop sleep (preStopSleepSeconds, %d s) plus grace (%d s) plus 5 s, or the kubelet kills tunnels that --grace lets run" (int .Values.terminationGracePeriodSeconds) $need $pre $grace) }}
{{- end }}
{{- end }}

{{/* The helm test's labels: not the broker's selector labels, which its Services and ClusterSPIFFEID select by. */}}
{{- define "tunnel-broker.testSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tunnel-broker.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tunnel-broker.testLabels" -}}
helm.sh/chart: {{ include "tunnel-broker.chart" . }}
{{ include "tunnel-broker.testSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kcp-tunnel-broker
app.kubernetes.io/component: test
{{- end }}
