"""`save_weights_external` through `tinker_compat` on a server without an HTTP front: the
export works (it is a checkpoint like any other), but its download URLs need the HTTP
front, so asking for them fails FAILED_PRECONDITION naming `--http-port`. The export and
its URLs with an HTTP front: tests/http/test_external_weights.py."""

from __future__ import annotations

import pytest
import tinker

from tinker_compat import RestClient

from .conftest import sft_data

pytestmark = pytest.mark.integration


def test_urls_need_the_http_front_and_say_so(service_client, base_url):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    path = tc.save_weights_external("no-http").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/no-http"
    with RestClient(base_url=base_url) as rest:
        listed = {c.tinker_path: c.checkpoint_type
                  for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed[path] == "external"
        with pytest.raises(tinker.ConflictError, match="--http-port"):
            rest.get_external_weights_urls(path).result()
        with pytest.raises(ValueError, match="external_weights"):
            rest.get_external_weights_urls(path.replace("external_weights", "weights"))
        rest.delete_checkpoint_from_tinker_path(path).result()
    # The refused and the served saves each took their seq_id: the next op runs.
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_weights_external("x", ttl_seconds=1).result(timeout=60)
    assert tc.forward(sft_data(n=1), "cross_entropy").result(timeout=60).loss_fn_outputs
