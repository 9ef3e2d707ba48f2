"""The Kafka side: what lands on Kafka and how.

Routing (event -> topic, key, value, headers; CloudEvents), the idempotent producer and its
delivery reports, topic names, the error policy for refused events, dead letters, exactly
once (the transactional producer and its checkpoint record in Kafka), and what the log says
while Kafka is away.

May import the database side (a dead letter is a row, CloudEvents checks a column); never the
relay or the commands.
"""
