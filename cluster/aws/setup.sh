#!/usr/bin/env bash
# Create the two instance profiles cluster/aws.yaml names, with the policies beside this file:
#   cluster/aws/setup.sh ACCOUNT_ID BUCKET
# vit-pipeline-ray-head: starts and stops the workers (Ray skips its own IAM set-up when the head
# names a profile, so the head must be allowed to launch them and to pass the workers' role), reads
# the Deep Learning AMI's SSM parameter (ImageId: resolve:ssm:...) and uses the bucket.
# vit-pipeline-ray-worker: the bucket only. Needs the AWS CLI and IAM rights; safe to re-run.
set -euo pipefail
account="${1:?usage: setup.sh ACCOUNT_ID BUCKET}"; bucket="${2:?usage: setup.sh ACCOUNT_ID BUCKET}"
[[ "$account" =~ ^[0-9]{12}$ ]] || { echo "ACCOUNT_ID must be 12 digits, got '$account'" >&2; exit 2; }
[[ "$bucket" =~ ^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$ ]] ||
  { echo "BUCKET must be an S3 bucket name (no s3://, no path), got '$bucket'" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
for who in head worker; do
  name="vit-pipeline-ray-$who"
  policy="$(sed -e "s/ACCOUNT_ID/$account/g" -e "s/BUCKET/$bucket/g" "$here/$who-policy.json")"
  aws iam get-role --role-name "$name" >/dev/null 2>&1 ||
    aws iam create-role --role-name "$name" --assume-role-policy-document "file://$here/trust-policy.json" >/dev/null
  aws iam put-role-policy --role-name "$name" --policy-name "$name" --policy-document "$policy"
  aws iam get-instance-profile --instance-profile-name "$name" >/dev/null 2>&1 || {
    aws iam create-instance-profile --instance-profile-name "$name" >/dev/null
    aws iam add-role-to-instance-profile --instance-profile-name "$name" --role-name "$name"
  }
  echo "instance profile $name: ready"
done
