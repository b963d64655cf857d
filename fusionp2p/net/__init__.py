"""Networking: how peers find, measure and talk to each other.

- ``identity.py``: the libp2p identity file and the RSA key that signs DHT records.
- ``dht_node.py``: starting this process's hivemind DHT node (with a parent watchdog).
- ``validation.py``: the validators every DHT node runs on records it stores or reads.
- ``directory.py``: the swarm's records in the DHT (peers, links, plans).
- ``directory_view.py``: a reader's cached view of the directory that refreshes what fell due.
- ``framing.py``: length-prefixed frames with a size limit and deadlines.
- ``limits.py``: stream counts, inbound byte budgets and rate-limited rejection logs.
- ``transport.py``: frame streams over libp2p and a rate-limited wrapper;
  ``memory_transport.py``: in-memory streams for unit tests.
- ``probe.py``: bandwidth and RTT probes, and the link estimator.
- ``connection.py``: SwarmConnection, a process's place in a swarm when it is not a peer.

The layers and how they fit: ``docs/architecture.md``.
"""
