{{/*
The router's --api-keys file: the Secret router.apiKeys.existingSecret, its key
router.apiKeys.existingSecretKey mounted read-only at /etc/tandem/api-keys/.
*/}}
{{- define "tandem.apiKeysPath" -}}
/etc/tandem/api-keys/{{ .Values.router.apiKeys.existingSecretKey }}
{{- end }}

{{- define "tandem.apiKeysVolumeMount" -}}
{{- if .Values.router.apiKeys.existingSecret }}
- name: api-keys
  mountPath: /etc/tandem/api-keys
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.apiKeysVolume" -}}
{{- if .Values.router.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.router.apiKeys.existingSecret }}
    items:
      - key: {{ .Values.router.apiKeys.existingSecretKey }}
        path: {{ .Values.router.apiKeys.existingSecretKey }}
{{- end }}
{{- end }}
