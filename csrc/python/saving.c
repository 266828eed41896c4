/* saving.c - prepare_for_saving / restore_from_saved (to be written). */
#include "module.h"

PyMethodDef tec_saving_methods[] = {
    {NULL, NULL, 0, NULL},
};
