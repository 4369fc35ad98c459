"""The GCP node provider cluster/gcp.yaml names: Ray's own, minus its change to project IAM.

Owns only the bootstrap: instances, SSH keys, subnets and TPUs stay Ray's GCPNodeProvider. Must not
create accounts or bind roles (docs/cluster.md, "Cluster launcher", says why and what Ray does).
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
    """Ray's GCP provider whose bootstrap leaves IAM alone.

    `ray up` with Ray's provider (2.60: gcp/config.py, bootstrap_gcp) always runs
    `_configure_iam_role`: it creates `ray-autoscaler-sa-v1` when missing and binds it project-wide
    to compute.admin, storage.objectAdmin, iam.serviceAccountUser and iam.roleViewer, even when every
    node type names its own account, as ours do (cluster/gcp/setup.sh makes it, with narrower roles).
    No setting skips that step, so gcp.yaml names this class (`provider: {type: external, module:
    ...}`): the same bootstrap without it, and a one-line refusal of a node type that names no
    account (it would run as the project's default compute account). The head's autoscaler imports
    this class from the image, which has vitp.
    """

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
