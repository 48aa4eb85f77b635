// CPU kernel of sbd::mask_scatter_ (to be written).
