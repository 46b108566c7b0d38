{{/*
KEDA ScaledObjects of the engine roles: the Prometheus scaler on the router's autoscaling
signals (services/router/scaling_metrics.py; docs/deploy.md, "Autoscaling with KEDA").
KEDA creates and owns the HPA of each role it scales, so the chart's own HPA for that
role must be off. Called with (dict "root" $ "role" "prefill"|"decode").
*/}}

{{/* "true" when KEDA scales this role, else empty. */}}
{{- define "tandem.kedaScales" -}}
{{- $k := .root.Values.keda }}
{{- if and $k.enabled (index $k .role).enabled }}true{{ end }}
{{- end }}

{{/* Label matchers of every query: this release's routers as the Prometheus Operator
labels what a ServiceMonitor scrapes, unless keda.metricSelector says otherwise. */}}
{{- define "tandem.kedaSelector" -}}
{{- $root := .root }}
{{- if $root.Values.keda.metricSelector }}
{{- $root.Values.keda.metricSelector }}
{{- else }}
{{- printf "namespace=%q,service=%q" $root.Release.Namespace (include "tandem.componentName" (dict "root" $root "role" "router")) }}
{{- end }}
{{- end }}

{{/* One Prometheus trigger. Called with (dict "root" $ "name" N "query" Q "threshold" T
"metricType" AverageValue|Value). */}}
{{- define "tandem.kedaTrigger" -}}
- type: prometheus
  name: {{ .name }}
  metricType: {{ .metricType }}
  metadata:
    serverAddress: {{ .root.Values.keda.serverAddress | quote }}
    query: {{ .query | quote }}
    threshold: {{ .threshold | toString | quote }}
    # NOTE: an empty answer (no sample in a latency window: no traffic) counts as 0.
    ignoreNullValues: "true"
    {{- with .root.Values.keda.authModes }}
    authModes: {{ . | quote }}
    {{- end }}
  {{- with .root.Values.keda.authenticationRef }}
  authenticationRef:
    name: {{ . }}
  {{- end }}
{{- end }}

{{/* The triggers of one role; a threshold of 0 leaves its trigger out. Queues and the
prefill backlog are per-replica targets (AverageValue: replicas = total / threshold);
latency and KV usage are whole-role values (Value: replicas grow in proportion to how
far the value is above its threshold). The per-role sums repeat on every router replica,
hence max; each router counts only its own prefill backlog, hence sum. */}}
{{- define "tandem.kedaTriggers" -}}
{{- $root := .root }}
{{- $r := index $root.Values.keda .role }}
{{- $sel := include "tandem.kedaSelector" . }}
{{- $role := printf "role=%q" .role }}
{{- $triggers := list }}
{{- if eq .role "prefill" }}
{{- if $r.backlogTokensPerReplica }}
{{- $triggers = append $triggers (dict "name" "prefill-backlog-tokens" "metricType" "AverageValue" "threshold" $r.backlogTokensPerReplica "query" (printf "sum(tandem:router_prefill_backlog_tokens{%s})" $sel)) }}
{{- end }}
{{- if $r.ttftP90Seconds }}
{{- $triggers = append $triggers (dict "name" "ttft-p90" "metricType" "Value" "threshold" $r.ttftP90Seconds "query" (printf "max(tandem:router_time_to_first_token_seconds_window{%s,quantile=\"0.9\"})" $sel)) }}
{{- end }}
{{- else }}
{{- if $r.kvCacheUsage }}
{{- $triggers = append $triggers (dict "name" "kv-cache-usage" "metricType" "Value" "threshold" $r.kvCacheUsage "query" (printf "max(tandem:router_role_kv_cache_usage_perc{%s,%s,stat=\"mean\"})" $sel $role)) }}
{{- end }}
{{- if $r.itlP90Seconds }}
{{- $triggers = append $triggers (dict "name" "itl-p90" "metricType" "Value" "threshold" $r.itlP90Seconds "query" (printf "max(tandem:router_inter_token_latency_seconds_window{%s,quantile=\"0.9\"})" $sel)) }}
{{- end }}
{{- end }}
{{- if $r.waitingRequestsPerReplica }}
{{- $triggers = append $triggers (dict "name" "waiting-requests" "metricType" "AverageValue" "threshold" $r.waitingRequestsPerReplica "query" (printf "max(tandem:router_role_num_requests_waiting{%s,%s})" $sel $role)) }}
{{- end }}
{{- if not $triggers }}
{{- fail (printf "keda.%s: every threshold is 0, so KEDA would have no trigger to scale the %s Deployment on; set one or keda.%s.enabled=false" .role .role .role) }}
{{- end }}
{{- range $triggers }}
{{ include "tandem.kedaTrigger" (merge (dict "root" $root) .) }}
{{- end }}
{{- end }}

{{- define "tandem.scaledObject" -}}
{{- if include "tandem.kedaScales" . }}
{{- $root := .root }}
{{- $k := $root.Values.keda }}
{{- if and $k.authenticationRef (not $k.authModes) }}
{{- fail "keda.authenticationRef needs keda.authModes (the Prometheus scaler's basic, bearer, tls or custom) to apply its credentials" }}
{{- end }}
{{- $r := index $k .role }}
{{- if (index $root.Values .role).autoscaling.enabled }}
{{- fail (printf "%s.autoscaling.enabled and keda.%s both scale the %s Deployment (KEDA owns the HPA it creates); turn one off" .role .role .role) }}
{{- end }}
{{- if lt (int $r.maxReplicas) (int $r.minReplicas) }}
{{- fail (printf "keda.%s.maxReplicas (%d) must be >= keda.%s.minReplicas (%d)" .role (int $r.maxReplicas) .role (int $r.minReplicas)) }}
{{- end }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "tandem.componentName" . }}
  pollingInterval: {{ $k.pollingInterval | int64 }}
  cooldownPeriod: {{ $k.cooldownPeriod | int64 }}
  minReplicaCount: {{ $r.minReplicas | int64 }}
  maxReplicaCount: {{ $r.maxReplicas | int64 }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        # NOTE: one pod at a time: each removed engine drains its in-flight requests
        # (terminationGracePeriodSeconds), so the rest of the role absorbs one drain at once.
        scaleDown:
          stabilizationWindowSeconds: {{ $k.scaleDownStabilizationWindowSeconds | int64 }}
          policies:
            - type: Pods
              value: 1
              periodSeconds: 60
  triggers:
    {{- include "tandem.kedaTriggers" . | trim | nindent 4 }}
{{- end }}
{{- end }}
