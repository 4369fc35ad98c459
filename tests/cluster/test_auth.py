"""Token authentication (RAY_AUTH_MODE=token) on a real local cluster: no token, no job."""
import pytest

from .conftest import vitp

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
def test_submission_without_the_token_is_refused_and_with_it_succeeds(auth_cluster, tmp_path):
    spec = tmp_path / "synth.yaml"
    corpus = tmp_path / "w"
    spec.write_text(f"entrypoint: vitp synth debug --set data.synth_images_per_class=2 --set work_dir={corpus}\n")

    refused = vitp("submit", str(spec), "--follow", "--address", auth_cluster.address)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "requires a token" in refused.stderr and "RAY_AUTH_TOKEN_PATH" in refused.stderr
    wrong = vitp("jobs", "list", "--address", auth_cluster.address, env={"RAY_AUTH_TOKEN": "not-the-token"})
    assert wrong.returncode == 3 and "rejected the token" in wrong.stderr

    token = {"RAY_AUTH_TOKEN_PATH": str(auth_cluster.token_path)}
    listed = vitp("jobs", "list", "--address", auth_cluster.address, env=token)
    assert listed.returncode == 0 and "no jobs" in listed.stdout  # nothing ran
    assert not corpus.exists()

    ok = vitp("submit", str(spec), "--follow", "--address", auth_cluster.address, env=token)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "SUCCEEDED" in ok.stdout
    assert len(list((corpus / "synth").rglob("*.png"))) + len(list((corpus / "synth").rglob("*.jpg"))) > 0
    # The token itself never appears in what vitp printed.
    secret = auth_cluster.token_path.read_text().strip()
    assert secret not in ok.stdout + ok.stderr
