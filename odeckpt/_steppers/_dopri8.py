"""Dormand-Prince 8(5,3): the method of Hairer's DOP853."""

from typing import ClassVar

import numpy as np

from ._explicit_rk import AbstractExplicitRK
from ._tableau import ButcherTableau

# Coefficients as published with DOP853 (Hairer, Norsett & Wanner vol. I), indices 1-based as
# there: _A_ROWS[i][j] = a_ij; only nonzero entries are listed. The stages are twelve; the
# thirteenth evaluation of DOP853, f(t1, y1), is the next step's first stage.
_A_ROWS = {
    2: {1: 5.26001519587677318785587544488e-2},
    3: {1: 1.97250569845378994544595329183e-2, 2: 5.91751709536136983633785987549e-2},
    4: {1: 2.95875854768068491816892993775e-2, 3: 8.87627564304205475450678981324e-2},
    5: {
        1: 2.41365134159266685502369798665e-1,
        3: -8.84549479328286085344864962717e-1,
        4: 9.24834003261792003115737966543e-1,
    },
    6: {
        1: 3.7037037037037037037037037037e-2,
        4: 1.70828608729473871279604482173e-1,
        5: 1.25467687566822425016691814123e-1,
    },
    7: {
        1: 3.7109375e-2,
        4: 1.70252211019544039314978060272e-1,
        5: 6.02165389804559606850219397283e-2,
        6: -1.7578125e-2,
    },
    8: {
        1: 3.70920001185047927108779319836e-2,
        4: 1.70383925712239993810214054705e-1,
        5: 1.07262030446373284651809199168e-1,
        6: -1.53194377486244017527936158236e-2,
        7: 8.27378916381402288758473766002e-3,
    },
    9: {
        1: 6.24110958716075717114429577812e-1,
        4: -3.36089262944694129406857109825,
        5: -8.68219346841726006818189891453e-1,
        6: 2.75920996994467083049415600797e1,
        7: 2.01540675504778934086186788979e1,
        8: -4.34898841810699588477366255144e1,
    },
    10: {
        1: 4.77662536438264365890433908527e-1,
        4: -2.48811461997166764192642586468,
        5: -5.90290826836842996371446475743e-1,
        6: 2.12300514481811942347288949897e1,
        7: 1.52792336328824235832596922938e1,
        8: -3.32882109689848629194453265587e1,
        9: -2.03312017085086261358222928593e-2,
    },
    11: {
        1: -9.3714243008598732571704021658e-1,
        4: 5.18637242884406370830023853209,
        5: 1.09143734899672957818500254654,
        6: -8.14978701074692612513997267357,
        7: -1.85200656599969598641566180701e1,
        8: 2.27394870993505042818970056734e1,
        9: 2.49360555267965238987089396762,
        10: -3.0467644718982195003823669022,
    },
    12: {
        1: 2.27331014751653820792359768449,
        4: -1.05344954667372501984066689879e1,
        5: -2.00087205822486249909675718444,
        6: -1.79589318631187989172765950534e1,
        7: 2.79488845294199600508499808837e1,
        8: -2.85899827713502369474065508674,
        9: -8.87285693353062954433549289258,
        10: 1.23605671757943030647266201528e1,
        11: 6.43392746015763530355970484046e-1,
    },
}
_B = {
    1: 5.42937341165687622380535766363e-2,
    6: 4.45031289275240888144113950566,
    7: 1.89151789931450038304281599044,
    8: -5.8012039600105847814672114227,
    9: 3.1116436695781989440891606237e-1,
    10: -1.52160949662516078556178806805e-1,
    11: 2.01365400804030348374776537501e-1,
    12: 4.47106157277725905176885569043e-2,
}
# DOP853's fifth-order error weights ("er_i"); DOP853 combines this estimate with a
# third-order one at the level of norms, which a per-component error cannot express.
_E5 = {
    1: 0.1312004499419488073250102996e-1,
    6: -0.1225156446376204440720569753e1,
    7: -0.4957589496572501915214079952,
    8: 0.1664377182454986536961530415e1,
    9: -0.3503288487499736816886487290,
    10: 0.3341791187130174790297318841,
    11: 0.8192320648511571246570742613e-1,
    12: -0.2235530786388629525884427845e-1,
}
_C = [
    0.0,
    0.526001519587677318785587544488e-1,
    0.789002279381515978178381316732e-1,
    0.118350341907227396726757197510,
    0.281649658092772603273242802490,
    1 / 3,
    1 / 4,
    4 / 13,
    127 / 195,
    3 / 5,
    6 / 7,
    1.0,
]


def _dense_vector(entries: dict[int, float]) -> np.ndarray:
    out = np.zeros(12)
    for j, value in entries.items():
        out[j - 1] = value
    return out


_DOPRI8 = ButcherTableau(
    a=np.stack([_dense_vector(_A_ROWS.get(i, {})) for i in range(1, 13)]),
    b=_dense_vector(_B),
    c=np.array(_C),
    b_error=_dense_vector(_E5),
)


class Dopri8(AbstractExplicitRK):
    """The Dormand-Prince 8(5,3) method of Hairer's code DOP853: eighth order, twelve stages
    (twelve evaluations per step, counting `f(t1, y1)`), cubic Hermite dense output.

    `y_error` is DOP853's embedded fifth-order estimate (`error_order = 5`, so it scales like
    `h^6`). DOP853 additionally blends in a third-order estimate when forming the error norm
    (`err5^2 / sqrt(err5^2 + 0.01 err3^2)`); that is a property of the norm, not of a
    per-component error, so it is not reproduced here.

    **References:** P. J. Prince & J. R. Dormand, "High order embedded Runge-Kutta formulae",
    *J. Comput. Appl. Math.* 7(1) (1981), 67-75; E. Hairer, S. P. Norsett & G. Wanner,
    *Solving Ordinary Differential Equations I*, 2nd ed. (1993), Sec. II.5 and II.10 (DOP853).

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Dopri8(), rtol=1e-7, atol=1e-9)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _DOPRI8
    name: ClassVar[str] = "dopri8"
    order: ClassVar[int] = 8
    error_order: ClassVar[int | None] = 5
    fn_evals_per_step: ClassVar[int] = _DOPRI8.fn_evals_per_step
    dense_degree: ClassVar[int] = _DOPRI8.dense_degree
