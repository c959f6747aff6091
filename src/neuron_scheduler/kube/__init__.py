"""Kubernetes glue: the only package that knows API paths, aiohttp and API errors.

- `errors`: typed API errors (`NotFound`, `Conflict`, `Gone`), `API_ERRORS`, `READ_ERRORS`.
- `config`: kubeconfig or in-cluster service account; the namespace this process runs in.
- `client`: `KubeAPI`, JSON over HTTPS with typed calls (pods, nodes, bindings, events, merge
  patches of our annotations).
- `objects`: the fields of Pods and Nodes we read (wire structs only).
- `reading`: what those objects mean for Neuron placement (a pod's request, a node's topology,
  our annotations on a bound pod).
- `watching`: list-then-watch into callbacks; `election`: a Lease for leader election.
- `backoff`, `tasks`: retry pacing and background task sets for everything above.
"""
