#!/usr/bin/env bash
# Create the service account cluster/gcp.yaml gives every node, with the roles the nodes need:
#   cluster/gcp/setup.sh PROJECT_ID BUCKET
# vit-pipeline-ray@PROJECT_ID.iam.gserviceaccount.com:
#   roles/compute.instanceAdmin.v1 (project)  the head's autoscaler creates and deletes the workers
#   roles/iam.serviceAccountUser (on itself)  ... and gives them this same account
#   roles/storage.objectAdmin (the bucket)    shards, checkpoints, exports, MLflow artifacts
# No key is created: the nodes get tokens from the metadata server. Needs gcloud and IAM rights;
# safe to re-run.
set -euo pipefail
project="${1:?usage: setup.sh PROJECT_ID BUCKET}"; bucket="${2:?usage: setup.sh PROJECT_ID BUCKET}"
[[ "$project" =~ ^[a-z][a-z0-9-]{4,28}[a-z0-9]$ ]] || { echo "PROJECT_ID must be a GCP project id, got '$project'" >&2; exit 2; }
[[ "$bucket" =~ ^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$ ]] ||
  { echo "BUCKET must be a bucket name (no gs://, no path), got '$bucket'" >&2; exit 2; }
account="vit-pipeline-ray@$project.iam.gserviceaccount.com"
gcloud iam service-accounts describe "$account" --project "$project" >/dev/null 2>&1 ||
  gcloud iam service-accounts create vit-pipeline-ray --project "$project" --display-name "vit-pipeline Ray nodes"
gcloud projects add-iam-policy-binding "$project" --member "serviceAccount:$account" \
  --role roles/compute.instanceAdmin.v1 --condition None >/dev/null
gcloud iam service-accounts add-iam-policy-binding "$account" --project "$project" \
  --member "serviceAccount:$account" --role roles/iam.serviceAccountUser >/dev/null
gcloud storage buckets add-iam-policy-binding "gs://$bucket" --member "serviceAccount:$account" \
  --role roles/storage.objectAdmin >/dev/null
echo "service account $account: ready"
