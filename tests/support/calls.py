"""What a rank's ring calls decided, recorded as the test runs them."""
from __future__ import annotations


def agreed_calls() -> list:
    """Every ``RingCall`` this process makes from now on, once its ranks agreed on it (its
    plan, loan and whether forward keeps the blocks it receives)."""
    from ringflex.parallel.ring import RingCall
    calls, agree = [], RingCall.agree

    def recording(call, device, length):
        agree(call, device, length)
        calls.append(call)
    RingCall.agree = recording
    return calls
