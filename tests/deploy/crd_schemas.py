"""Structural schemas of the Prometheus Operator objects deploy/ uses (monitoring.coreos.com/v1).

The Kubernetes schemas of kubernetes-validate cover only the built-in kinds. These are the
parts of the PodMonitor and PrometheusRule CRDs that cdc-relay's manifests use, with their
types, required fields and duration format as the CRDs define them, and no other field
allowed: a misspelt or misplaced key fails instead of being ignored by the API server.
The rule groups are also the format of a plain Prometheus rules file.
"""

from __future__ import annotations

from typing import Any

# The CRDs' duration pattern (Prometheus durations: 30s, 5m, 1h30m, 0).
DURATION = {
    "type": "string",
    "pattern": (
        r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
        r"(([0-9]+)s)?(([0-9]+)ms)?)$"
    ),
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


LABEL_SELECTOR = strict(
    {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": strict(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)
METADATA = strict(
    {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    ("name",),
)

RULE = {
    **strict(
        {
            "alert": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"},
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "expr": {"type": "string", "minLength": 1},
            "for": DURATION,
            "keep_firing_for": DURATION,
            "labels": STRING_MAP,
            "annotations": STRING_MAP,
        },
        ("expr",),
    ),
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
RULE_GROUPS = strict(
    {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": strict(
                {
                    "name": {"type": "string", "minLength": 1},
                    "interval": DURATION,
                    "query_offset": DURATION,
                    "limit": {"type": "integer", "minimum": 0},
                    "labels": STRING_MAP,
                    "rules": {"type": "array", "items": RULE},
                },
                ("name", "rules"),
            ),
        }
    },
    ("groups",),
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": METADATA,
            "spec": strict(
                {
                    "selector": LABEL_SELECTOR,
                    "namespaceSelector": strict(
                        {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        }
                    ),
                    "jobLabel": {"type": "string"},
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "items": strict(
                            {
                                "port": {"type": "string"},
                                "portNumber": {"type": "integer", "minimum": 1},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": DURATION,
                                "scrapeTimeout": DURATION,
                                "honorLabels": {"type": "boolean"},
                            }
                        ),
                    },
                },
                ("selector",),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
    "PrometheusRule": strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": METADATA,
            "spec": RULE_GROUPS,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
}
