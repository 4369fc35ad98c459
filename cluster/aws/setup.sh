#!/usr/bin/env bash
# Create what cluster/aws.yaml names, once per account:
#   cluster/aws/setup.sh ACCOUNT_ID BUCKET VPC_ID SSH_CIDR
# vit-pipeline-ray-head (instance profile): starts and stops the workers (Ray skips its own IAM
# set-up when the head names a profile, so the head must be allowed to launch them and to pass the
# workers' role), reads the Deep Learning AMI's SSM parameter (ImageId: resolve:ssm:...), pulls the
# image from ECR and uses the bucket.
# vit-pipeline-ray-worker (instance profile): the bucket and pulling the image, nothing else.
# vit-pipeline-nodes (security group in VPC_ID): all traffic between the nodes, which EFA needs in
# and out, and Ray's ports; SSH from SSH_CIDR only (your address, e.g. 203.0.113.7/32).
# vit-pipeline-p5 (cluster placement group): the GPU nodes on one network spine.
# Needs the AWS CLI and IAM/EC2 rights; safe to re-run. It prints the security group's ID for
# cluster/aws.yaml (sg-REPLACE_ME).
set -euo pipefail
usage="usage: setup.sh ACCOUNT_ID BUCKET VPC_ID SSH_CIDR"
account="${1:?$usage}"; bucket="${2:?$usage}"; vpc="${3:?$usage}"; cidr="${4:?$usage}"
[[ "$account" =~ ^[0-9]{12}$ ]] || { echo "ACCOUNT_ID must be 12 digits, got '$account'" >&2; exit 2; }
[[ "$bucket" =~ ^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$ ]] ||
  { echo "BUCKET must be an S3 bucket name (no s3://, no path), got '$bucket'" >&2; exit 2; }
[[ "$vpc" =~ ^vpc-[0-9a-f]{8,17}$ ]] || { echo "VPC_ID must look like vpc-0123456789abcdef0, got '$vpc'" >&2; exit 2; }
[[ "$cidr" =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}/([0-9]|[12][0-9]|3[0-2])$ ]] ||
  { echo "SSH_CIDR must be an IPv4 CIDR such as 203.0.113.7/32, got '$cidr'" >&2; exit 2; }
[[ "$cidr" != */0 ]] || { echo "SSH_CIDR $cidr opens SSH to every address: give yours, e.g. 203.0.113.7/32" >&2; exit 2; }
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
sg="$(aws ec2 describe-security-groups --filters Name=vpc-id,Values="$vpc" Name=group-name,Values=vit-pipeline-nodes \
      --query 'SecurityGroups[0].GroupId' --output text)"
if [[ "$sg" == None ]]; then
  sg="$(aws ec2 create-security-group --vpc-id "$vpc" --group-name vit-pipeline-nodes \
        --description "vit-pipeline Ray nodes: all traffic among themselves (EFA), SSH from one CIDR" \
        --query GroupId --output text)"
fi
# A rule that exists already is an error to the API (InvalidPermission.Duplicate): re-runs pass it.
rule() { out="$("$@" 2>&1)" || [[ "$out" == *InvalidPermission.Duplicate* ]] || { echo "$out" >&2; exit 1; }; }
rule aws ec2 authorize-security-group-ingress --group-id "$sg" --protocol -1 --source-group "$sg"
rule aws ec2 authorize-security-group-egress --group-id "$sg" --ip-permissions \
  "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]"
rule aws ec2 authorize-security-group-ingress --group-id "$sg" --protocol tcp --port 22 --cidr "$cidr"
echo "security group vit-pipeline-nodes: $sg (put it in cluster/aws.yaml for sg-REPLACE_ME)"
aws ec2 describe-placement-groups --group-names vit-pipeline-p5 >/dev/null 2>&1 ||
  aws ec2 create-placement-group --group-name vit-pipeline-p5 --strategy cluster >/dev/null
echo "placement group vit-pipeline-p5: ready"
