"""The GCP node provider cluster/gcp.yaml names: Ray's own, minus its change to project IAM.

`ray up` with Ray's GCP provider (2.60: autoscaler/_private/gcp/config.py, bootstrap_gcp) always
runs `_configure_iam_role`: it creates the service account `ray-autoscaler-sa-v1` when missing and
binds it project-wide to compute.admin, storage.objectAdmin, iam.serviceAccountUser and
iam.roleViewer (setIamPolicy on the project), even when every node type names its own account, as
ours do (cluster/gcp/setup.sh makes it, with narrower roles). There is no setting to skip that
step, so gcp.yaml names this class (`provider: {type: external, module: ...}`): the same bootstrap
without the IAM step, and a one-line refusal of a node type that names no account (it would get
the project's default compute account). Everything else (instances, SSH keys, subnets, TPUs) is
Ray's GCPNodeProvider, unchanged. The head's autoscaler imports it from the image, which has vitp.
"""
from __future__ import annotations

import copy

from ray.autoscaler._private.gcp.config import (
    HAS_TPU_PROVIDER_FIELD,
    _configure_key_pair,
    _configure_project,
    _configure_subnet,
    _has_tpus_in_node_configs,
    construct_clients_from_provider_config,
)
from ray.autoscaler._private.gcp.node_provider import GCPNodeProvider
from ray.autoscaler._private.util import check_legacy_fields


def _accountless(config: dict) -> list[str]:
    return sorted(name for name, t in config.get("available_node_types", {}).items()
                  if not t.get("node_config", {}).get("serviceAccounts"))


class NodeProvider(GCPNodeProvider):
    """Ray's GCP provider whose bootstrap leaves IAM alone (see the module's docstring)."""

    @staticmethod
    def bootstrap_config(cluster_config: dict) -> dict:
        missing = _accountless(cluster_config)
        if missing:
            raise ValueError(f"node type(s) {', '.join(missing)} name no serviceAccounts: give each the account "
                             "cluster/gcp/setup.sh creates (node_config.serviceAccounts), as cluster/gcp.yaml does")
        config = copy.deepcopy(cluster_config)
        check_legacy_fields(config)
        config["head_node"] = {}  # Ray's slot for the head's account: each node type names its own
        if _has_tpus_in_node_configs(config):
            config["provider"][HAS_TPU_PROVIDER_FIELD] = True
        crm, _iam, compute, _tpu = construct_clients_from_provider_config(config["provider"])
        config = _configure_project(config, crm)
        config = _configure_key_pair(config, compute)
        return _configure_subnet(config, compute)
