"""Who a sender grants pulls to (shared/holding/grants.py): the reader a reply inbox names, against
the receiver models that may read the sender's model."""

from __future__ import annotations

import pytest

from droidmesh.services.sender.config import SenderConfig
from droidmesh.shared import ZOO_DIR
from droidmesh.shared.errors import ConfigError, UnauthorizedError
from droidmesh.shared.holding.grants import Readers, check
from droidmesh.shared.wire.subjects import inbox_prefix


def _inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.Zx81kQp2.7"  # what a nats-py request's reply looks like


def _readers() -> Readers:
    readers = Readers("summ", configured=("qa",))
    readers.pair("paired")
    return readers


@pytest.mark.parametrize("reply", [_inbox("receiver-summ"), _inbox("receiver-qa"), _inbox("receiver-paired"),
                                   _inbox("admin")])
@pytest.mark.parametrize("authenticated", [True, False])
def test_readers_of_the_model_and_operators_are_granted(reply, authenticated):
    check(_readers(), reply, authenticated)


@pytest.mark.parametrize("authenticated", [True, False])
def test_a_receiver_of_another_model_is_refused(authenticated):
    with pytest.raises(UnauthorizedError, match="receivers of intruder"):
        check(_readers(), _inbox("receiver-intruder"), authenticated)


@pytest.mark.parametrize("reply", ["$SRV.grab.1", _inbox("client"), _inbox("sender-s2"), "_INBOX.Zx81kQp2.7", "",
                                   "dm.cache.available.s1", f"{inbox_prefix('receiver-qa')}x.1"])
def test_under_auth_a_reply_that_is_no_readers_inbox_is_refused(reply):
    """A subject an asker may read though it is no inbox, another role's inbox, the shared prefix of
    connections without a user, none (the in-process bus), a prefix merely starting like a reader's."""
    with pytest.raises(UnauthorizedError):
        check(_readers(), reply, authenticated=True)


def test_without_auth_an_unnamed_asker_is_granted():
    """Every inbox is readable without auth: the check binds nobody there (the in-process bus names none)."""
    for reply in ("_INBOX.Zx81kQp2.7", ""):
        check(_readers(), reply, authenticated=False)


def test_any_reader_and_pairs_are_compared_as_subject_tokens():
    """'*' admits every model; a model id with characters no subject token holds matches its token."""
    check(Readers("summ", configured=("*",)), _inbox("receiver-intruder"), authenticated=True)
    readers = Readers("summ")
    assert readers.pair("org/qa.v2") and not readers.pair("org/qa.v2")
    check(readers, _inbox("receiver-org_qa_v2"), authenticated=True)


def test_readers_must_name_models():
    with pytest.raises(ConfigError, match="readers"):
        SenderConfig(model_path=str(ZOO_DIR / "demo" / "summ"), readers=("qa", " "))
    assert SenderConfig(model_path=str(ZOO_DIR / "demo" / "summ"), readers=("qa",)).readers == ("qa",)
