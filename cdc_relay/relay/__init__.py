"""The relay: the one loop and its two feeds.

``pipeline`` runs source -> decode -> route -> sink -> checkpoint over the stages that
``stages`` declares; ``stream`` configures it for a replication slot, ``poller`` and ``batch``
for claimed outbox rows; ``lsn_tracker`` is the LSN tracker, fed by Kafka's delivery reports.

Imports the database side and the Kafka side; never the operations or the commands.
"""
