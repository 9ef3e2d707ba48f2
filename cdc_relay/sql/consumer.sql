-- For consumers: the ids of the events a consumer has handled, written in the same
-- transaction as the consumer's own changes, so a redelivered event is skipped
-- (cdc_relay.consumer). Apply once per consumer database (idempotent):
-- cdc-relay schema apply consumer --dsn "$DSN"
-- A table made by an older version has event_id uuid, which takes UUID ids only: for ids of
-- another form, ALTER TABLE processed_events ALTER COLUMN event_id TYPE text.

CREATE TABLE IF NOT EXISTS processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,  -- the id header as it is: a UUID, or any --column id
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Old ids can go once no redelivery can reach back that far (e.g. older than the topic's
-- retention): DELETE FROM processed_events WHERE processed_at < now() - interval '30 days';
