"""The HTTP routes, one router a module; `server/app.py` includes each of them.

- `service`: what the server says of itself (/health, /version, /metrics, /v1/models).
- `generation`: the OpenAI generation endpoints (/v1/chat/completions, /v1/completions).
- `tokenize`: /tokenize and /detokenize (vLLM's shapes).
- `admin`: the operator routes under /internal/, behind the API key.
- `json_bodies`: reading a request's JSON body and answering with one, for all of them.

Routes are thin: they read the app's `ServerState` (server/state.py), validate, call the serving
layer and answer with JSON or a stream.
"""
