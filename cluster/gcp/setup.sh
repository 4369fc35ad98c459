#!/usr/bin/env bash
# Create what cluster/gcp.yaml names, once per project:
#   cluster/gcp/setup.sh PROJECT_ID BUCKET [REGION]        # REGION: gcp.yaml's, us-central1
# vit-pipeline-ray@PROJECT_ID.iam.gserviceaccount.com, the account every node runs as:
#   roles/compute.instanceAdmin.v1 (project)  the head's autoscaler creates and deletes the workers
#   roles/iam.serviceAccountUser (on itself)  ... and gives them this same account
#   roles/storage.objectAdmin (the bucket)    shards, checkpoints, exports, MLflow artifacts
#   roles/artifactregistry.reader (project)   pulls the image when it is in Artifact Registry
# No key is created: the nodes get tokens from the metadata server. `ray up` itself changes no IAM
# (gcp.yaml's provider is vitp/cluster/gcp_provider.py, which skips Ray's ray-autoscaler-sa-v1).
# vit-pipeline-gpu-1..4: one VPC and subnet each (MTU 8244, traffic among the nodes allowed), for
# the four GPUDirect-TCPX NICs of an a3-highgpu-8g.
# vit-pipeline-a3: a compact placement policy, so the GPU nodes land close together.
# Needs gcloud and IAM/Compute rights; safe to re-run.
set -euo pipefail
usage="usage: setup.sh PROJECT_ID BUCKET [REGION]"
project="${1:?$usage}"; bucket="${2:?$usage}"; region="${3:-us-central1}"
[[ "$project" =~ ^[a-z][a-z0-9-]{4,28}[a-z0-9]$ ]] || { echo "PROJECT_ID must be a GCP project id, got '$project'" >&2; exit 2; }
[[ "$bucket" =~ ^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$ ]] ||
  { echo "BUCKET must be a bucket name (no gs://, no path), got '$bucket'" >&2; exit 2; }
[[ "$region" =~ ^[a-z]+-[a-z]+[0-9]+$ ]] || { echo "REGION must be a region such as us-central1, got '$region'" >&2; exit 2; }
account="vit-pipeline-ray@$project.iam.gserviceaccount.com"
gcloud iam service-accounts describe "$account" --project "$project" >/dev/null 2>&1 ||
  gcloud iam service-accounts create vit-pipeline-ray --project "$project" --display-name "vit-pipeline Ray nodes"
for role in roles/compute.instanceAdmin.v1 roles/artifactregistry.reader; do
  gcloud projects add-iam-policy-binding "$project" --member "serviceAccount:$account" \
    --role "$role" --condition None >/dev/null
done
gcloud iam service-accounts add-iam-policy-binding "$account" --project "$project" \
  --member "serviceAccount:$account" --role roles/iam.serviceAccountUser >/dev/null
gcloud storage buckets add-iam-policy-binding "gs://$bucket" --member "serviceAccount:$account" \
  --role roles/storage.objectAdmin >/dev/null
echo "service account $account: ready"
for i in 1 2 3 4; do
  net="vit-pipeline-gpu-$i"
  gcloud compute networks describe "$net" --project "$project" >/dev/null 2>&1 ||
    gcloud compute networks create "$net" --project "$project" --subnet-mode custom --mtu 8244 >/dev/null
  gcloud compute networks subnets describe "$net" --project "$project" --region "$region" >/dev/null 2>&1 ||
    gcloud compute networks subnets create "$net" --project "$project" --region "$region" --network "$net" \
      --range "192.168.$i.0/24" >/dev/null
  gcloud compute firewall-rules describe "$net-internal" --project "$project" >/dev/null 2>&1 ||
    gcloud compute firewall-rules create "$net-internal" --project "$project" --network "$net" \
      --allow tcp,udp,icmp --source-ranges "192.168.$i.0/24" >/dev/null
done
echo "GPU networks vit-pipeline-gpu-1..4 in $region: ready"
gcloud compute resource-policies describe vit-pipeline-a3 --project "$project" --region "$region" >/dev/null 2>&1 ||
  gcloud compute resource-policies create group-placement vit-pipeline-a3 --project "$project" --region "$region" \
    --collocation collocated >/dev/null
echo "placement policy vit-pipeline-a3: ready"
