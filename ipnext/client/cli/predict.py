"""`ipnext predict MODEL --inputs JSON [--source REGION | --region REGION] [--key KEY]`: one
prediction over HTTP, with nothing but the serving URL (no Temporal)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ipnext.client.cli._common import print_json
from ipnext.errors import IpnextError
from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `predict` command and its verbs, on the CLI's subparsers."""
    predict = sub.add_parser("predict", help="ask a model for a prediction over HTTP (no Temporal needed)")
    predict.add_argument("model")
    predict.add_argument("--inputs", required=True, help="the request inputs as JSON")
    predict.add_argument(
        "--source", help="the caller's region; the model's routing document picks the serving region"
    )
    predict.add_argument("--region", help="the serving region to ask directly")
    predict.add_argument("--key", help="sticky key: the same key lands on the same region and set")
    predict.set_defaults(run=_predict)


def _predict(args: argparse.Namespace, settings: Settings) -> None:
    try:
        inputs = json.loads(args.inputs)
    except json.JSONDecodeError as err:
        raise IpnextError(
            f"--inputs is not JSON: {err}",
            field="--inputs",
            fix='pass e.g. \'{"user": 1, "items": [1, 2]}\'',
        ) from None
    # The data plane only: the routing document and the model's router. Not through
    # ipnext.client.sdk, which would load the Temporal client for nothing.
    from ipnext.client.prediction import PredictionClient

    with PredictionClient.from_settings(settings) as serving:
        reply = serving.predict(args.model, inputs, source=args.source, region=args.region, key=args.key)
    print_json(reply)
