"""The least-privilege tests fail on an authorization refusal, and only on that."""

from tandem.testing.rbac import rbac_denials

DENIED = ('deployments.apps "a" is forbidden: User "system:serviceaccount:ns:op" cannot patch '
          'resource "deployments" in API group "apps" in the namespace "ns"')


def test_authorization_refusals_are_found_in_plain_and_json_logs() -> None:
    as_json = '{"message": "' + DENIED.replace('"', '\\"') + '", "severity": "error"}'
    # kopf's JSON log of an API exception quotes the response body once more.
    body_in_json = DENIED.replace('"', '\\\\\\"')
    kopf = "Not enough permissions to watch for resources: changes will not be noticed"
    log = "\n".join(["applied ns/a in 0.1s", DENIED, as_json, body_in_json, kopf])
    assert rbac_denials(log) == [DENIED, as_json, body_in_json, kopf]


def test_a_terminating_namespace_is_not_an_rbac_problem() -> None:
    terminating = ('events "x." is forbidden: unable to create new content in namespace t '
                   'because it is being terminated')
    assert rbac_denials(terminating) == []
