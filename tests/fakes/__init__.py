"""Stand-ins for the servers model-prefetch talks to, all on 127.0.0.1 and standard library only:

* :mod:`tests.fakes.hubserver`: a Hugging Face Hub (API, /resolve, a CDN port) with fault rules;
* :mod:`tests.fakes.misbehaving`: an S3-compatible server that lies on request (ignores Range,
  trickles, stalls, sends short or long bodies), over HTTPS given the session CA;
* :mod:`tests.fakes.s3proxy`: a proxy in front of the real local S3 server (SeaweedFS) that
  corrupts or cuts response bodies and throttles them, over HTTPS given the session CA;
* :mod:`tests.fakes.forward_proxy`: a forward proxy (absolute-form requests, CONNECT tunnels)
  that counts what passes through it;
* :mod:`tests.fakes.tlsserver`: HTTPS for the standard library's threading HTTP server (the
  handshake in each connection's thread; handshakes counted);
* :mod:`tests.fakes.memory`: a Source over bytes in memory (no server), for the engine and sync
  tests;
* :mod:`tests.fakes.k8s_stub`: a Kubernetes API server for nodes (labels, taints, JSON Patch),
  used through the real kubernetes client.
"""
