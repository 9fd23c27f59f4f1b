"""PolyBeast: env clients stream to the learner's ActorPool server over gRPC.

server.py   the ActorPool service: token check, one session per client stream, central inference
batcher.py  the dynamic batcher behind central inference
rollouts.py per-client unroll assembly, partial rollouts at resets and disconnects
shards.py   the server's work in K processes (backend.server_shards), joined to central inference
            and the learner by shared memory
local.py    env clients on the learner's machine over shared memory instead of gRPC
client.py   the env client (a process that steps envs and asks the server for actions)
backend.py  the PolyBeast backend: server + central inference + local clients (role=all|learner|env)
wire.py     the protobuf wire format (actorpool.proto)
settings.py backend=poly's config: role, address, token, batching and limits
"""
