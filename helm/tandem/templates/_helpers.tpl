{{/*
Names, labels and the pieces several templates share. Component templates pass a dict
`(dict "root" $ "role" "<component>")` where a helper needs to know the component.
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release alone when it already holds the chart name. */}}
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

{{/* Name of one component's resources. NOTE: truncated to 52 so suffixes such as
"-headless" and StatefulSet pod ordinals still fit DNS's 63. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .role | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

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

{{/* Selector labels of one component: stable across upgrades (selectors are immutable). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.configMapName" -}}
{{- printf "%s-config" (include "tandem.fullname" .) }}
{{- end }}

{{/* Redis URL of the bundled Redis, or the external one from values. */}}
{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/%d" (include "tandem.componentName" (dict "root" . "role" "redis")) (int .Values.redis.port) (int .Values.redis.database) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* --model: the folder at model.path, or model.file inside it. */}}
{{- define "tandem.modelArg" -}}
{{- if .Values.model.file }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.path) .Values.model.file }}
{{- else }}
{{- .Values.model.path }}
{{- end }}
{{- end }}

{{/* Address prefill and decode write KV blocks to (--kvstore). */}}
{{- define "tandem.kvstoreAddress" -}}
{{- if eq .Values.kvstore.kind "DaemonSet" }}
{{- printf "$(TANDEM_HOST_IP):%d" (int .Values.kvstore.port) }}
{{- else }}
{{- printf "%s:%d" (include "tandem.componentName" (dict "root" . "role" "kvstore")) (int .Values.kvstore.port) }}
{{- end }}
{{- end }}

{{/* Environment every tandem container gets: its own identity (downward API) and the
secrets that must not sit in the ConfigMap. The shared settings come via envFrom. */}}
{{- define "tandem.env" -}}
- name: TANDEM_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: TANDEM_POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: TANDEM_HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret }}
- name: TANDEM_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- end }}
{{- end }}

{{- define "tandem.envFrom" -}}
- configMapRef:
    name: {{ include "tandem.configMapName" . }}
{{- end }}

{{/* Rolls pods when the shared settings change. */}}
{{- define "tandem.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{/* The model volume (none when the weights are in the image). */}}
{{- define "tandem.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end }}

{{- define "tandem.modelVolumeMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Mutual TLS on the internal gRPC hop: the secret (tls.crt, tls.key, ca.crt, as
cert-manager writes them) mounted read-only into the router and every engine. */}}
{{- define "tandem.tlsDir" -}}/etc/tandem/tls{{- end }}

{{- define "tandem.tlsVolume" -}}
{{- if .Values.internalTLS.enabled }}
- name: internal-tls
  secret:
    secretName: {{ required "internalTLS.secretName is required when internalTLS.enabled" .Values.internalTLS.secretName }}
{{- end }}
{{- end }}

{{- define "tandem.tlsVolumeMount" -}}
{{- if .Values.internalTLS.enabled }}
- name: internal-tls
  mountPath: {{ include "tandem.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* --tls-* flags of one side (both present the secret's certificate and require the
peer's to chain to its CA). */}}
{{- define "tandem.tlsArgs" -}}
{{- if .Values.internalTLS.enabled }}
{{- $d := include "tandem.tlsDir" . }}
- --tls-cert={{ $d }}/tls.crt
- --tls-key={{ $d }}/tls.key
- --tls-ca={{ $d }}/ca.crt
{{- end }}
{{- end }}

{{/* --otlp-traces-* flags of every component (tracing.otlpTracesEndpoint; off when ""). */}}
{{- define "tandem.tracingArgs" -}}
{{- with .Values.tracing.otlpTracesEndpoint }}
- --otlp-traces-endpoint={{ . }}
{{- with $.Values.tracing.otlpTracesProtocol }}
- --otlp-traces-protocol={{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* /dev/shm for UCX's shared-memory transport. */}}
{{- define "tandem.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ucx.shmSizeLimit }}
{{- end }}

{{- define "tandem.shmVolumeMount" -}}
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{/* Pod and container security settings for the tandem image (user 10001). */}}
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
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Pod scheduling fields of one component's values (nodeSelector, tolerations, affinity). */}}
{{- define "tandem.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* --device of an engine role: explicit, or cuda exactly when the pod has GPUs. */}}
{{- define "tandem.device" -}}
{{- if .device }}{{ .device }}{{ else if gt (int .gpus) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* Resources of an engine role, with nvidia.com/gpu in requests and limits when gpus > 0.
NOTE: deepCopy so that adding the GPU entry never mutates .Values for later templates. */}}
{{- define "tandem.engineResources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (int .gpus)) (default dict $res.requests)) }}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int .gpus)) (default dict $res.limits)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* HorizontalPodAutoscaler of a Deployment component. */}}
{{- define "tandem.hpa" -}}
{{- $v := index .root.Values .role }}
{{- if $v.autoscaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "tandem.componentName" . }}
  minReplicas: {{ $v.autoscaling.minReplicas }}
  maxReplicas: {{ $v.autoscaling.maxReplicas }}
  metrics:
    {{- if $v.autoscaling.metrics }}
    {{- toYaml $v.autoscaling.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $v.autoscaling.targetCPUUtilizationPercentage }}
    {{- end }}
{{- end }}
{{- end }}

{{/* PodDisruptionBudget of one component. */}}
{{- define "tandem.pdb" -}}
{{- $v := index .root.Values .role }}
{{- if $v.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $v.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}
