"""Serving many users from several machines: the document worker as Ray Serve replicas (docs/scaling.md).

launch.py   connect to a Ray cluster, deploy one Serve deployment per replica, return the client
replica.py  the deployment's class: one model and its session pool; loads and answers stream plain dicts
client.py   the app's side: the Q&A tab's worker calls, each user kept on the replica holding their document
replicas.py one replica's handle as the client calls it: Ray's failures become ReplicaDown; stops forwarded
views.py    what crosses the boundary: a document's view, errors as messages, RemoteDocument

Ray is imported only here, and only when the app runs with --ray.
"""
