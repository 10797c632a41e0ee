{{/* The mirror's pod template; called with (dict "root" $ "job" <an entry of mirror.jobs>). */}}
{{- define "model-prefetch.mirrorPod" -}}
{{- $root := .root -}}
{{- $m := $root.Values.mirror -}}
metadata:
  labels:
    {{- include "model-prefetch.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: mirror
spec:
  serviceAccountName: {{ include "model-prefetch.mirrorServiceAccountName" $root }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  # A new pod per attempt (its logs stay readable); the mirror resumes from S3's state.
  restartPolicy: Never
  # SIGTERM stops new parts; the uploads in progress are resumed by the next run.
  terminationGracePeriodSeconds: 60
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: mirror
      image: {{ include "model-prefetch.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args:
        - mirror
        - {{ .job.source | quote }}
        - {{ .job.destination | quote }}
        - --json
        - --no-progress
      env:
        {{- with $m.awsRegion }}
        - name: AWS_REGION
          value: {{ . | quote }}
        {{- end }}
        {{- with $m.hfTokenSecret }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: HF_TOKEN
              optional: true
        {{- end }}
        - name: HF_HUB_DISABLE_TELEMETRY
          value: "1"
        - name: HOME
          value: /tmp
        - name: XDG_CACHE_HOME
          value: /tmp/.cache
        {{- with $m.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $m.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        privileged: false
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        runAsNonRoot: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: tmp
          mountPath: /tmp
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: 256Mi
{{- end -}}
