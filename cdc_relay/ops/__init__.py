"""Operations beside the relay: tracing one event, a slot's status, pruning the outbox, and
the handover from a polling relay (or a backlog) to a slot.

May import everything but the commands.
"""
