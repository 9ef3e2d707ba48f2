"""Operations beside the relay: tracing one event, pruning the outbox, and the handover from
a polling relay (or a backlog) to a slot.

May import everything but the commands.
"""
