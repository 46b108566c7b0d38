{{/*
Prefill and decode run the same engine in different roles, so one definition renders
both Deployments and both Services; prefill-*.yaml and decode-*.yaml only pick the role.
Called with (dict "root" $ "role" "prefill"|"decode").
*/}}

{{/* Flags of `tandem prefill|decode`; each mirrors an engine config field (see values.yaml). */}}
{{- define "tandem.engine.args" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
- --listen=0.0.0.0:{{ $v.port }}
- --advertise-address=$(TANDEM_POD_IP):{{ $v.port }}
- --model={{ include "tandem.modelArg" $root }}
- --redis-url=$(TANDEM_REDIS_URL)
- --kvstore={{ include "tandem.kvstoreAddress" $root }}
- --metrics-port={{ $v.metricsPort }}
- --device={{ include "tandem.device" $v }}
{{- $workers := mul (int $v.tensorParallelSize) (int $v.pipelineParallelSize) }}
{{- if and (gt (int $v.gpus) 0) (ne (int $v.gpus) (int $workers)) }}
{{- fail (printf "%s.gpus (%d) must be %s.tensorParallelSize x pipelineParallelSize (%d): one GPU per engine worker process, or 0 for CPU" .role (int $v.gpus) .role (int $workers)) }}
{{- end }}
- --tensor-parallel-size={{ $v.tensorParallelSize | int64 }}
- --pipeline-parallel-size={{ $v.pipelineParallelSize | int64 }}
{{- if $v.enableExpertParallel }}
{{- if lt (int $v.tensorParallelSize) 2 }}
{{- fail (printf "%s.enableExpertParallel needs %s.tensorParallelSize >= 2 (the experts are split over the tensor-parallel workers)" .role .role) }}
{{- end }}
- --enable-expert-parallel
{{- end }}
- --dtype={{ $root.Values.model.dtype }}
{{- with $root.Values.model.modelImpl }}
- --model-impl={{ . }}
{{- end }}
{{- with $root.Values.model.quantization }}
- --quantization={{ . }}
{{- end }}
- --block-size={{ $root.Values.cache.blockSize | int64 }}
- --kv-cache-dtype={{ $root.Values.cache.kvCacheDtype | default "auto" }}
- {{ ternary "--kv-events" "--no-kv-events" $root.Values.kvEvents.enabled }}
{{- with $root.Values.model.maxModelLen }}
- --max-model-len={{ . | int64 }}
{{- end }}
{{- with $v.cache.kvCacheMemoryBytes }}
- --kv-cache-memory={{ . | int64 }}
{{- end }}
{{- with $v.cache.gpuMemoryUtilization }}
- --gpu-memory-utilization={{ . }}
{{- end }}
{{- with $v.scheduler.maxNumBatchedTokens }}
- --max-num-batched-tokens={{ . | int64 }}
{{- end }}
{{- with $v.scheduler.maxNumSeqs }}
- --max-num-seqs={{ . | int64 }}
{{- end }}
{{- with $v.scheduler.schedulingPolicy }}
- --scheduling-policy={{ . }}
{{- end }}
{{- /* Speculative decoding runs where tokens are decoded (the decode role). */}}
{{- if and (eq .role "decode") $v.speculative }}
{{- $s := $v.speculative }}
{{- $cfg := dict "method" $s.method }}
{{- with $s.numSpeculativeTokens }}{{ $_ := set $cfg "num_speculative_tokens" (int64 .) }}{{ end }}
{{- with $s.promptLookupMin }}{{ $_ := set $cfg "prompt_lookup_min" (int64 .) }}{{ end }}
{{- with $s.promptLookupMax }}{{ $_ := set $cfg "prompt_lookup_max" (int64 .) }}{{ end }}
{{- with $s.model }}{{ $_ := set $cfg "model" . }}{{ end }}
- {{ printf "--speculative-config=%s" (toJson $cfg) | quote }}
{{- end }}
{{- /* Drain (health NOT_SERVING, deregister, finish in-flight requests) within the
pod's grace period, leaving 10 s to exit before the kubelet kills it. */}}
- --shutdown-grace-s={{ max 1 (sub (int $v.terminationGracePeriodSeconds) 10) }}
{{- with (include "tandem.tlsArgs" $root | trim) }}
{{ . }}
{{- end }}
{{- with (include "tandem.tracingArgs" $root | trim) }}
{{ . }}
{{- end }}
{{- with $v.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The engines' probe: grpc.health.v1, or a TCP connect when the port speaks only
TLS. Called with the role's values plus "tls". */}}
{{- define "tandem.engineProbe" -}}
{{- if .tls }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}

{{- define "tandem.engine.deployment" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  {{- /* an HPA (the chart's or KEDA's) sets the replicas when it scales the role */}}
  {{- if not (or $v.autoscaling.enabled (include "tandem.kedaScales" .)) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  strategy:
    # NOTE: GPUs are the scarce resource: never ask for more pods' worth of GPUs than the
    # role already holds during a rollout.
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 0
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "tandem.selectorLabels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "tandem.configChecksum" $root | nindent 8 }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "tandem.podSecurityContext" $root | nindent 8 }}
      {{- with (include "tandem.scheduling" $v | trim) }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ .role }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem", {{ .role | quote }}]
          args:
            {{- include "tandem.engine.args" . | trim | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
          envFrom:
            {{- include "tandem.envFrom" $root | nindent 12 }}
          env:
            {{- include "tandem.env" $root | nindent 12 }}
          # grpc.health.v1 on the --listen port (a TCP connect with internalTLS: the kubelet's
          # gRPC probe speaks no TLS); the startup probe covers loading the weights and
          # profiling the KV cache, then readiness gates traffic and liveness restarts a
          # wedged engine.
          startupProbe:
            {{- include "tandem.engineProbe" (dict "port" $v.port "tls" $root.Values.internalTLS.enabled) | nindent 12 }}
            periodSeconds: {{ $v.startupProbe.periodSeconds }}
            failureThreshold: {{ $v.startupProbe.failureThreshold }}
          readinessProbe:
            {{- include "tandem.engineProbe" (dict "port" $v.port "tls" $root.Values.internalTLS.enabled) | nindent 12 }}
            periodSeconds: 10
            failureThreshold: 3
          livenessProbe:
            {{- include "tandem.engineProbe" (dict "port" $v.port "tls" $root.Values.internalTLS.enabled) | nindent 12 }}
            periodSeconds: 20
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- include "tandem.engineResources" $v | nindent 12 }}
          securityContext:
            {{- include "tandem.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "tandem.shmVolumeMount" $root | nindent 12 }}
            {{- with (include "tandem.modelVolumeMount" $root | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- with (include "tandem.tlsVolumeMount" $root | trim) }}{{ . | nindent 12 }}{{ end }}
      volumes:
        {{- include "tandem.shmVolume" $root | nindent 8 }}
        {{- with (include "tandem.modelVolume" $root | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with (include "tandem.tlsVolume" $root | trim) }}{{ . | nindent 8 }}{{ end }}
{{- end }}

{{/* Headless Service: stable DNS for the pods and the metrics port for the ServiceMonitor.
The router finds instances in the Redis registry, not through this Service. */}}
{{- define "tandem.engine.service" -}}
{{- $v := index .root.Values .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
    tandem-metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "tandem.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
    - name: metrics
      port: {{ $v.metricsPort }}
      targetPort: metrics
      protocol: TCP
{{- end }}
