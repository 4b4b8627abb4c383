"""`ForwardSensitivity`: forward sensitivities integrated with the state, under its error
control."""

from ._adjoint import ForwardSensitivity as ForwardSensitivity
