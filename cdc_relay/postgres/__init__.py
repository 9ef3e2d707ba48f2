"""The database side: everything that reads or sets up PostgreSQL.

The replication connection (the only code that speaks the streaming protocol), the pure
decoders of pgoutput and wal2json, the outbox tables by identity, the slot and publication
(set-up, what a publication covers, resharding), shards and their cuts, the slot's lineage and
the gaps it shows, logical decoding messages, failover slots, the prune horizon, the watcher,
and the poller's outbox store.

Nothing here imports the Kafka side, the relay or the commands.
"""
