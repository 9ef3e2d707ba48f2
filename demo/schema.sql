-- The demo order service's own table; its events go to outbox_events (sql/outbox.sql).
CREATE TABLE IF NOT EXISTS orders (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text        NOT NULL,
    total      numeric     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
